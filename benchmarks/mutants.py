"""Mutation check of the test suite: plausible bugs injected into a copy of the repository must each fail a test.

Each mutant is one search/replace on a source file (the `MUTANTS` table below; keep `old` on a line other work is
unlikely to rewrite). For every mutant the script copies the repository (tracked and untracked, non-ignored files)
to a temporary directory, applies the replacement there -- a mutant whose `old` text is not found exactly once is
an ERROR (the table needs updating), never "caught" -- and runs the mutant's test files in the copy with
`pytest -x` (fast and slow tiers alike) and `PYTHONPATH` pointing at the copy. It prints one row per mutant: which test caught
it, SURVIVED, or ERROR, with the measured wall time. Exit status 1 if any mutant survived or errored.

    python benchmarks/mutants.py                 # all mutants, one at a time
    python benchmarks/mutants.py --list          # the table
    python benchmarks/mutants.py --only NAME...  # some of them
    python benchmarks/mutants.py --jobs 2        # mutants in parallel (each its own copy and pytest)
    python benchmarks/mutants.py --baseline      # first check the unmutated copy passes each test set
    python benchmarks/mutants.py --only NAME --tests tests/test_x.py::test_y   # what else catches it
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    area: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]      # test files or node ids, run in this order with -x
    bug: str


MUTANTS: tuple[Mutant, ...] = (
    # ---- the five bugs of issue 17
    Mutant("stage-replay-drops-gradient", "stage plans", "cfp/runtime/stage/replay.py",
           "return (jax.tree_util.tree_unflatten(self._params_tree, flat[:n]), list(flat[n:]),",
           "return (acc, list(flat[n:]),",
           ("tests/test_stage_plans.py",),
           "searched stages add nothing to their gradient accumulator"),
    Mutant("searched-stage-program-rebuilt", "stage plans", "cfp/runtime/stage/cases.py",
           "return cache.get(Built.PROGRAM, case.program_key(plan_choice), build)",
           "return build()",
           ("tests/test_stage_plans.py::test_search_then_training_builds_each_stage_program_once",),
           "the engine rebuilds (and recompiles) the stage programs the stage-plan search built"),
    Mutant("timeline-dropped-when-incomplete", "runtime", "cfp/runtime/training.py",
           "    if opts.timeline_dir and jax.process_index() == 0:\n",
           "    if opts.timeline_dir and jax.process_index() == 0 and not tl.unmeasured:\n",
           ("tests/test_timeline.py",),
           "a step the host was too busy to watch in full writes no timeline, though --timeline-dir asked for one"),
    Mutant("engine-drops-weight-decay", "runtime", "cfp/runtime/engine.py",
           "return optax.adamw(learning_rate, weight_decay=weight_decay)",
           "return optax.adamw(learning_rate)",
           ("tests/test_runtime.py",),
           "the engine's AdamW has no weight decay"),
    Mutant("planner-ignores-tp-all-reduce", "planner", "cfp/planner/costmodel.py",
           "ar = m.layer_all_reduces(st.tp) * self.tp_all_reduce_seconds(st.machine, st.tp, mb * m.boundary_bytes())",
           "ar = 0.0",
           ("tests/test_planner_measured.py", "tests/test_planner.py"),
           "the planner's stage time leaves out tensor-parallel all-reduces"),
    Mutant("planner-stage-ignores-layer-count", "planner", "cfp/planner/costmodel.py",
           "compute = (st.layers * self.layer_seconds(st.machine, st.tp, mb, spilled)",
           "compute = (self.layer_seconds(st.machine, st.tp, mb, spilled)",
           ("tests/test_planner.py", "tests/test_planner_measured.py"),
           "the planner prices a stage's compute as one layer whatever its layer count"),
    Mutant("planner-cache-spill-ignored", "planner", "cfp/planner/costmodel.py",
           "spilled = self.spills(st, mb, last)",
           "spilled = False",
           ("tests/test_costmodel_features.py",),
           "the planner prices every stage's memory-bound work at the in-cache rate, however large its working set"),
    Mutant("gather-sync-sums-in-passes", "planner", "cfp/planner/costmodel.py",
           "self._stream_seconds(machine, (n - 1) * nbytes)",
           "self._stream_seconds(machine, (n - 1) * 3 * nbytes)",
           ("tests/test_costmodel_features.py",),
           "the planner prices the gradient sum as n - 1 separate adds, not the update program's fused reads"),
    Mutant("varlen-loss-pipeline-0-only", "data", "cfp/runtime/executor.py",
           "            self.loss_parts[idx] = out",
           "            self.loss_parts[idx] = out if a.pipeline == 0 else (out[0] * 0, out[1])",
           ("tests/test_data_switch.py",),
           "the engine's loss counts pipeline 0's micro-batches only"),
    Mutant("varlen-grads-over-padded-slots", "data", "cfp/models/layered.py",
           "        total = jnp.sum(w)",
           "        total = jnp.float32(w.size)",
           ("tests/test_data_switch.py",),
           "the zoo's loss weighs a micro-batch by its token slots (padding included) instead of its real tokens"),
    Mutant("sync-drops-other-pipelines", "runtime", "cfp/runtime/executor.py",
           "dprog.grad_shardings) for p in range(len(layout.pipelines))]",
           "dprog.grad_shardings) for p in range(len(layout.pipelines))[:1]]",
           ("tests/test_data_switch.py",),
           "gradient sync sums pipeline 0's gradients only: the other pipelines' tokens leave the update"),
    Mutant("switch-loses-optimizer-state", "runtime", "cfp/runtime/engine.py",
           "            self.load_state(*state)",
           "            self.load_state(state[0], self.tx.init(state[0]), state[2])",
           ("tests/test_data_switch.py",),
           "a strategy switch resets the optimizer state instead of moving it"),
    Mutant("search-ignores-resharding", "search", "cfp/search/search.py",
           "trans.append([[gpu_estimate.reshard_cost(analysis, x, y, link * 1e9, comm) for y in b] for x in a])",
           "trans.append([[0.0 for y in b] for x in a])",
           ("tests/test_references.py", "tests/test_search.py", "tests/test_golden_plans.py"),
           "the search's DP gets no resharding cost between segments"),
    # ---- more plausible bugs, one or more per area
    Mutant("dp-drops-transition", "search", "cfp/search/dp.py",
           "t + trans[i - 1][j][k] + cost[i][k]",
           "t + cost[i][k]",
           ("tests/test_search.py",),
           "the DP adds segment times but forgets the transition between picks"),
    Mutant("one-f-one-b-warmup-off-by-one", "runtime", "cfp/schedules/registry.py",
           "warm = min(num_stages - s - 1, num_microbatches)",
           "warm = min(num_stages - s, num_microbatches)",
           ("tests/test_runtime.py",),
           "1F1B warms up one micro-batch too many on every stage"),
    Mutant("weight-of-a-micro-batch-left-out", "runtime", "cfp/runtime/executor.py",
           "loss_sum, weight = float(np.sum(parts[:, 0])), float(np.sum(parts[:, 1]))",
           "loss_sum, weight = float(np.sum(parts[:, 0])), float(np.sum(parts[1:, 1]))",
           ("tests/test_user_pipelines.py", "tests/test_runtime.py"),
           "the step's total weight leaves out one micro-batch's weight: loss and gradient scaled wrong"),
    Mutant("layer-pieces-off-by-one", "runtime", "cfp/runtime/executor.py",
           "        a, b = lo - src.layer_start, hi - src.layer_start",
           "        a, b = lo - src.layer_start + 1, hi - src.layer_start + 1",
           ("tests/test_user_pipelines.py", "tests/test_runtime.py"),
           "gradient sync takes the source stage's layer slice one layer off (stacked or listed layers)"),
    Mutant("reshard-all-gather-bytes", "sharding", "cfp/sharding/reshard.py",
           'yield out, ("all-gather", nbytes / (shards // mesh_shape[a]), mesh_shape[a])',
           'yield out, ("all-gather", nbytes / shards, mesh_shape[a])',
           ("tests/test_references.py",
            "tests/test_reshard.py::test_path_price_is_the_gathers_and_all_to_alls_not_a_full_replica"),
           "a resharding all-gather is priced at its input shard instead of its gathered output"),
    Mutant("megatron-rules-leave-mlp-replicated", "sharding", "cfp/sharding/rules.py",
           '    Rule("mlp", required=True),\n',
           "",
           ("tests/test_planner_measured.py", "tests/test_planner.py"),
           "the Megatron table loses its MLP rule: under TP the MLP weights stay replicated"),
    Mutant("ring-all-reduce-moves-half", "profiling", "cfp/hardware/collectives.py",
           "return base + 2 * (n - 1) * latency_s + 2 * (n - 1) / n * nbytes / link_bytes_per_s",
           "return base + 2 * (n - 1) * latency_s + (n - 1) / n * nbytes / link_bytes_per_s",
           ("tests/test_collectives.py", "tests/test_profiling.py"),
           "a ring all-reduce is priced like an all-gather (half its traffic)"),
    Mutant("profile-top-k-fastest-only", "profiling", "cfp/profiling/table.py",
           "small = sorted(self.entries, key=lambda e: (e.memory, e.time))[:top_k]",
           "small = []",
           ("tests/test_profiling.py",),
           "a segment's candidates for the DP keep the fastest profiled combinations, never the leanest"),
    Mutant("strategies-skip-divisibility", "analysis", "cfp/analysis/strategies.py",
           "if all(loops[li].size % n == 0 for li, n in per_loop.items()):",
           "if True:",
           ("tests/test_references.py", "tests/test_analysis.py"),
           "a loop is offered to several mesh axes whose product does not divide it"),
    Mutant("search-ignores-trip-count", "search", "cfp/search/search.py",
           "cost.append([e.time * seg.repeat + extra for e, _, extra, _ in row])",
           "cost.append([e.time + extra for e, _, extra, _ in row])",
           ("tests/test_scan.py",),
           "the search counts a scan body's segment once, whatever its trip count"),
    Mutant("state-sharding-cuts-the-layer-dim", "sharding", "cfp/sharding/specs.py",
           "if left(d, spec) % n == 0 and d not in whole)",
           "if left(d, spec) % n == 0)",
           ("tests/test_scan.py",),
           "state sharding may shard a scan's stacked layer dim"),
    Mutant("body-profile-drops-update", "profiling", "cfp/profiling/subprogram.py",
           "chosen = {SegmentPart.ALL: body + update + ports,",
           "chosen = {SegmentPart.ALL: body,",
           ("tests/test_scan.py::test_a_body_segment_profile_holds_its_layers_share_of_the_stacked_update",),
           "a scan body's segment profile leaves out its layer's share of the stacked parameters' update"),
    Mutant("remat-in-scan-unpaired", "analysis", "cfp/analysis/blocks.py",
           "if remat and op.primitive == \"scan_enter\":",
           "if False:",
           ("tests/test_remat.py::test_remat_inside_a_scan_analyses_like_its_plain_scanned_twin",),
           "a remat inside a scan body leaves its recomputed dots unpaired from their forward dots"),
    Mutant("scan-replay-forgets-reverse", "capture", "cfp/ir/capture.py",
           "length=region.length, reverse=region.reverse,",
           "length=region.length, reverse=False,",
           ("tests/test_capture.py", "tests/test_scan.py"),
           "a seen-through reverse scan (the backward pass over layers) is replayed forwards"),
    Mutant("packed-positions-run-on", "data", "cfp/data/batching.py",
           'out["positions"][row, sl] = np.arange(n)',
           'out["positions"][row, sl] = np.arange(at, at + n)',
           ("tests/test_data_packing.py",),
           "positions of a packed row continue across sequences instead of restarting at 0"),
    Mutant("packing-bound-counts-whole-bubble", "data", "cfp/data/packing.py",
           "return work + (scheme.pp - 1) * max(work / m, alone)",
           "return work + scheme.pp * max(work / m, alone)",
           ("tests/test_data_assign.py",),
           "the packing search's lower bound charges pp (not pp-1) slowest micro-batches, so it skips counts "
           "that would have won"),
    Mutant("min-count-rounds-room-down", "data", "cfp/data/packing.py",
           "spill = np.maximum(0, -(-(sum3 - (n2 * max_len - sum2)) // max_len))",
           "spill = np.maximum(0, -(-(sum3 - (n2 * max_len - sum2 - 1)) // max_len))",
           ("tests/test_data_assign.py",),
           "the bin lower bound leaves one token less of room beside the long sequences, so it can exceed "
           "the least micro-batch count and skip feasible counts"),
    Mutant("packing-forgets-parked-micro-batches", "data", "cfp/data/packing.py",
           "np.asarray(got, np.int64)]), heap + [e[1:] for e in parked]",
           "np.asarray(got, np.int64)]), heap",
           ("tests/test_data_assign.py",),
           "the packing greedy leaves the micro-batches it set aside as full out of the pipeline time it reports"),
    Mutant("step-sequences-short", "data", "cfp/data/train.py",
           "n = int(np.searchsorted(np.cumsum(lens), tokens_per_step)) + 1",
           "n = int(np.searchsorted(np.cumsum(lens), tokens_per_step))",
           ("tests/test_references.py", "tests/test_data_train.py"),
           "`cfp data train` draws one sequence too few, so a step falls short of its token budget"),
    Mutant("data-train-same-draw-every-step", "data", "cfp/data/train.py",
           "ids = step_sequences(data, step, opts.seed, opts.tokens_per_step)",
           "ids = step_sequences(data, 0, opts.seed, opts.tokens_per_step)",
           ("tests/test_data_train.py",),
           "`cfp data train` draws the same sequences at every step"),
    Mutant("scheme-space-memory-without-temporaries", "data", "cfp/xla/compiled.py",
           "total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes",
           "total = m.argument_size_in_bytes + m.output_size_in_bytes",
           ("tests/test_data_train.py",),
           "the measured scheme space leaves XLA's temporaries out of a scheme's memory, so max_len overshoots"),
    Mutant("verify-reference-drops-weight-decay", "runtime", "cfp/runtime/verify.py",
           "return optax.adamw(learning_rate, weight_decay=weight_decay)",
           "return optax.adamw(learning_rate)",
           ("tests/test_references.py",),
           "the --verify reference's AdamW has no weight decay, so it no longer checks the engine's"),
    # ---- issue 28: memory figures against compiled programs, the profile cache key, validators, CP
    Mutant("planner-last-stage-drops-head-activations", "planner memory", "cfp/planner/costmodel.py",
           "a0 = (inputs + (mb * m.head_activation_bytes(tp) if last else 0.0)",
           "a0 = (inputs + 0.0",
           ("tests/test_memory_invariants.py::test_planner_working_set_against_the_compiled_backward",),
           "a last stage's memory leaves out the LM head's logits and loss activations"),
    Mutant("planner-tp-state-not-split", "planner memory", "cfp/planner/costmodel.py",
           "return (ends(m.param_bytes), m.param_bytes(Part.LAYER, tp), ends(m.optimizer_bytes),",
           "return (ends(m.param_bytes), m.param_bytes(Part.LAYER), ends(m.optimizer_bytes),",
           ("tests/test_memory_invariants.py::test_planner_state_is_the_compiled_state",),
           "a TP>1 stage's parameters and optimizer state are counted whole where the runtime splits them"),
    Mutant("planner-first-stage-stores-activations", "planner memory", "cfp/planner/costmodel.py",
           "inputs = n_in * mb * (m.token_bytes() if first and v == 1 else m.boundary_bytes())",
           "inputs = n_in * mb * m.boundary_bytes()",
           ("tests/test_memory_invariants.py::test_planner_stored_inputs_are_the_schedules",),
           "the first stage's stored micro-batch inputs are priced as hidden activations, not int32 tokens"),
    Mutant("planner-fsdp-state-over-other-pipelines", "planner memory", "cfp/planner/step_features.py",
           "return 1.0 / among(n_pipes).n if self.grad_sync is GradSync.SHARDED else 1.0",
           "return 1.0 / max(1, among(n_pipes).n - 1) if self.grad_sync is GradSync.SHARDED else 1.0",
           ("tests/test_memory_invariants.py::test_planner_sharded_state_is_the_compiled_fsdp_steps",),
           "FSDP's sharded state is divided among the other pipelines, not all of them"),
    Mutant("zero3-saving-over-the-first-axis", "search memory", "cfp/search/state_sharding.py",
           "after = g.tensor(t).nbytes // shards(zero, mesh)",
           "after = g.tensor(t).nbytes // (shards(spec, mesh) * mesh[0])",
           ("tests/test_memory_invariants.py::test_search_state_saving_is_the_compiled_arguments_drop",),
           "the search's ZeRO-3 saving divides a block's state by the first mesh axis, not the axes it is cut over"),
    Mutant("donated-bytes-whole-replicas", "search memory", "cfp/sharding/specs.py",
           "total += t.nbytes // shards(dim_axes(shardings.input_specs[i], names, len(t.shape)), shape)",
           "total += t.nbytes",
           ("tests/test_memory_invariants.py::test_search_state_saving_is_the_compiled_arguments_drop",),
           "a donating step's budget subtracts whole state tensors, not each device's shard of them"),
    Mutant("cache-key-ignores-mesh-shape", "profiling", "cfp/profiling/cachekey.py",
           'f"mesh {analysis.mesh.shape} axes {analysis.mesh.axis_names}",',
           'f"mesh axes {analysis.mesh.axis_names}",',
           ("tests/test_profile_cache_key.py::test_each_input_changed_alone_from_the_defaults_changes_the_key",
            "tests/test_profile_cache_key.py::test_changing_any_one_input_changes_the_key"),
           "the profile cache key leaves out the mesh shape: a 4x2 mesh reads the 2x4 mesh's profiles"),
    Mutant("cache-key-drops-operator-params", "profiling", "cfp/profiling/cachekey.py",
           'lines.append(f"b{block_of[o]} {program.operator_text(o)} ({ins}) -> ({outs}) backward={op.backward}")',
           'lines.append(f"b{block_of[o]} {op.primitive} ({ins}) -> ({outs}) backward={op.backward}")',
           ("tests/test_profile_cache_key.py::test_each_input_changed_alone_from_the_defaults_changes_the_key",
            "tests/test_profile_cache_key.py::test_changing_any_one_input_changes_the_key"),
           "the profile cache key names each operator's primitive but not its params or literal operands"),
    Mutant("cache-key-ignores-per-block", "profiling", "cfp/profiling/cachekey.py",
           'for k in ("cache_dir", "progress"):',
           'for k in ("cache_dir", "progress", "per_block"):',
           ("tests/test_profile_cache_key.py::test_each_input_changed_alone_from_the_defaults_changes_the_key",
            "tests/test_profile_cache_key.py::test_changing_any_one_input_changes_the_key"),
           "the profile cache key leaves out per_block, which changes the combinations a pruned segment profiles"),
    Mutant("layout-accepts-zero-layer-stage", "layout", "cfp/layout.py",
           "if not _is_int(st.layers) or st.layers <= 0:",
           "if not _is_int(st.layers) or st.layers < 0:",
           ("tests/test_validators_property.py",),
           "a layout accepts a stage of zero layers"),
    Mutant("layout-accepts-device-twice-in-a-pipeline", "layout", "cfp/layout.py",
           "if len(facts[1]) != len(devices):",
           "if False:",
           ("tests/test_validators_property.py",),
           "a layout accepts a device used twice within one pipeline (its check of the pipelines sees sets)"),
    Mutant("cluster-count-accepts-bool", "planner", "cfp/planner/cluster.py",
           "if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:\n"
           "        raise ConfigError(f\"{what}={value!r} must be a positive integer\")",
           "if not isinstance(value, numbers.Integral) or value <= 0:\n"
           "        raise ConfigError(f\"{what}={value!r} must be a positive integer\")",
           ("tests/test_validators_property.py",),
           "a cluster file's count: true is taken as one device"),
    Mutant("plan-choice-range-unchecked", "search", "cfp/search/plan.py",
           "    check_choice_range(choice, n, where)\n",
           "",
           ("tests/test_validators_property.py",),
           "a plan file whose choice names a strategy a block does not have loads"),
    Mutant("cp-ring-ignores-segments", "models", "cfp/models/attention.py",
           "ok = q_seg[:, :, None] == k_seg[:, None, :]",
           "ok = (q_seg[:, :, None] >= 0) | (k_seg[:, None, :] >= 0)",
           ("tests/test_context_parallel.py",),
           "context-parallel attention lets packed sequences attend across their segment boundaries"),
    Mutant("cp-ring-skips-a-step", "models", "cfp/models/attention.py",
           "*_, l, acc = jax.lax.fori_loop(0, n, body, (k, v, q_seg, q_pos, m0, l0, acc0))",
           "*_, l, acc = jax.lax.fori_loop(0, n - 1, body, (k, v, q_seg, q_pos, m0, l0, acc0))",
           ("tests/test_context_parallel.py",),
           "ring attention stops one step short: each query chunk misses one chunk of keys"),
    # ---- cost facts derived from a LayeredModel (issue 26, item 4)
    Mutant("facts-backward-flops-left-out", "planner", "cfp/layered/derive.py",
           "backward_flops=grads1 * _ratio(j.dot_flops, one.dot_flops) / rows,",
           "backward_flops=0.0,",
           ("tests/test_cost_facts.py::test_mixer_splits_follow_names_or_megatron_guess",),
           "the derived facts leave out the backward's FLOPs"),
    Mutant("facts-activations-per-micro-batch", "planner", "cfp/layered/derive.py",
           "activation_bytes=xla.act * ra / rows,",
           "activation_bytes=xla.act * ra,",
           ("tests/test_cost_facts.py::test_facts_are_per_row_whatever_the_example_micro_batch",),
           "a layer's kept activations are the example micro-batch's, not scaled to the planned micro-batch"),
    Mutant("facts-all-reduces-uncounted", "planner", "cfp/layered/derive.py",
           "            ar += rep * ds.out_bytes",
           "            ar += 0.0",
           ("tests/test_cost_facts.py::test_mixer_splits_follow_names_or_megatron_guess",),
           "the derived facts count no all-reduce after a dot that contracts a split dim"),
    Mutant("facts-splits-not-walked", "planner", "cfp/layered/marks.py",
           "                if da in self.of(ta):\n                    self.mark(tb, db)",
           "                pass",
           ("tests/test_cost_facts.py::test_mixer_splits_follow_names_or_megatron_guess",),
           "a tensor-parallel split does not flow through elementwise ops, so no dot is seen row-parallel"),
    Mutant("planner-optimizer-state-ignored", "planner", "cfp/planner/costmodel.py",
           "return 2 * (self.s0 + n * self.s1) + self.o0 + n * self.o1",
           "return 2 * (self.s0 + n * self.s1)",
           ("tests/test_cost_facts.py::test_optimizer_state_is_the_optimizers_own",),
           "the planner's stage memory leaves out the optimizer's state"),
    Mutant("optimizer-layer-reduction-one-stage", "runtime", "cfp/runtime/optimizer/partition.py",
           "env[v] = functools.reduce(COMBINE[an.flow.reductions[v]], parts)",
           "env[v] = parts[0]",
           ("tests/test_optimizer_partition.py",),
           "a reduction over the stacked layers (the global norm's sum) takes the first stage's layers only"),
    Mutant("optimizer-two-units-mix", "runtime", "cfp/runtime/optimizer/flow.py",
           "        if len(big_units) > 1:\n",
           "        if len(big_units) > 2:\n",
           ("tests/test_optimizer_partition.py",),
           "an update adding one leaf's whole gradient to another stage's leaf is not refused"),
    Mutant("optimizer-reshape-splits-layers", "runtime", "cfp/ir/_jax_internals.py",
           "row > 0 and per_layer % row == 0",
           "row > 0",
           ("tests/test_optimizer_partition.py",),
           "a reshape that splits a stacked leaf's layers across rows (optax.flatten) is run per stage"),
    Mutant("optimizer-export-round-per-unit", "runtime", "cfp/runtime/optimizer/flow.py",
           "if via < out.round + 1:",
           "if False:",
           ("tests/test_optimizer_partition.py",),
           "a running sum of per-leaf norms is sent unit by unit, one exchange round per unit"),
    # ---- pipeline schedules beyond 1F1B (issue 27)
    Mutant("zb-h1-drops-deferred-w", "schedules", "cfp/schedules/registry.py",
           "out.append(row + [Action(Phase.BWD_WEIGHT, j, s) for j in waiting])",
           "out.append(row)",
           ("tests/test_schedules.py",),
           "ZB-H1 drops the weight gradients it deferred past the last backward"),
    Mutant("zb-h1-runs-a-w-twice", "schedules", "cfp/schedules/registry.py",
           "row.append(Action(Phase.BWD_WEIGHT, waiting.pop(0), s))",
           "row.append(Action(Phase.BWD_WEIGHT, waiting[0], s))",
           ("tests/test_schedules.py",),
           "ZB-H1 runs the oldest deferred W again instead of the next one"),
    Mutant("generator-runs-a-w-twice", "schedules", "cfp/schedules/generate.py",
           "return self.pending_w[d].popleft() if self.pending_w[d] else None",
           "return self.pending_w[d][0] if self.pending_w[d] else None",
           ("tests/test_schedules.py",),
           "the generator runs a deferred W without taking it off the stage's list"),
    Mutant("simulated-b-before-its-gradient", "schedules", "cfp/schedules/simulate.py",
           "return self.fwd_done[c][j] <= t and (c == self.S - 1 or self.grad_at[c + 1][j] <= t)",
           "return self.fwd_done[c][j] <= t",
           ("tests/test_schedules.py",),
           "a B starts before the next virtual stage's gradient has arrived"),
    Mutant("dispatched-b-before-its-gradient", "schedules", "cfp/schedules/actions.py",
           "        deps.append((Phase.BWD_INPUT, c + 1, j))      # the gradient of c's output",
           "        pass",
           ("tests/test_schedules.py",),
           "the executor's order lets a backward run before the next virtual stage's backward"),
    Mutant("v-chunk-on-the-wrong-stage", "schedules", "cfp/schedules/actions.py",
           "return tuple(range(p)) + tuple(reversed(range(p)))",
           "return tuple(range(p)) + tuple(range(p))",
           ("tests/test_schedules.py",),
           "ZB-V places its second virtual stages in a loop, not back up the V"),
    Mutant("validation-ignores-placement", "schedules", "cfp/schedules/actions.py",
           "if table.placement[a.vstage] != d:",
           "if False:",
           ("tests/test_schedules.py",),
           "a table running a virtual stage on another stage than it is placed on passes validation"),
    Mutant("runtime-drops-w", "schedules", "cfp/runtime/executor.py",
           "        acc, done = prog.backward_weight(self.params[key], self.kept.pop((key, m)), self._batch(a, prog),\n"
           "                                         self._acc(key, prog))\n"
           "        self.acc[key] = acc\n",
           "        _, done = prog.backward_weight(self.params[key], self.kept.pop((key, m)), self._batch(a, prog),\n"
           "                                       self._acc(key, prog))\n",
           ("tests/test_runtime.py::test_matches_single_device_gpipe_and_1f1b",),
           "the executor runs W but drops its weight gradient from the stage's accumulator"),
    Mutant("runtime-w-counted-twice", "schedules", "cfp/runtime/stage/kept.py",
           "        return self._grads(cut, env, acc), jnp.zeros((), jnp.float32)",
           "        return self._grads(cut, env, self._grads(cut, env, acc)), jnp.zeros((), jnp.float32)",
           ("tests/test_runtime.py::test_matches_single_device_gpipe_and_1f1b",),
           "W adds the micro-batch's weight gradient twice"),
    Mutant("runtime-b-sends-no-gradient", "schedules", "cfp/runtime/stage/kept.py",
           "        return (self._g_x(cut, env), Kept(kept.sig, tuple(env[i] for i in cut.split.handoff)),",
           "        return ([jnp.zeros_like(g) for g in self._g_x(cut, env)], "
           "Kept(kept.sig, tuple(env[i] for i in cut.split.handoff)),",
           ("tests/test_runtime.py::test_matches_single_device_gpipe_and_1f1b",),
           "B hands the previous stage a gradient that ignores its output's (the earlier stages' W see nothing)"),
    Mutant("planner-ignores-w-stashes", "planner", "cfp/planner/costmodel.py",
           "                   + n_stash / v * m.layer_weight_stash_bytes(tp))",
           "                   + 0.0)",
           ("tests/test_planner_schedules.py",),
           "the cost model prices a split backward's W stashes at nothing, so zero-bubble schedules look free"),
    Mutant("w-priced-with-attention-dots", "planner", "cfp/costs.py",
           "        return self._m((\"lwg\", tp, mb), lambda: self._layer_gemms(tp, mb, kernels_only=True))",
           "        return self._m((\"lwg\", tp, mb), lambda: self._layer_gemms(tp, mb))",
           ("tests/test_planner_schedules.py",),
           "W is priced with the attention dots, which have no weights, and stashes their operands"),
    Mutant("planner-limit-is-the-whole-device", "planner", "cfp/planner/schedule_choice.py",
           "out.append(cm.cluster.machines[st.machine].memory - others)",
           "out.append(cm.cluster.machines[st.machine].memory)",
           ("tests/test_planner_schedules.py",),
           "the generated schedule may keep the whole device's memory in activations"),
    # ---- issue 29: variable-length data that runs faster
    Mutant("blocked-attention-skips-shared-block", "data", "cfp/models/packed_attention.py",
           "keep = (lo[:, qi] <= hi[:, kj]) & (lo[:, kj] <= hi[:, qi])",
           "keep = (lo[:, qi] < hi[:, kj]) & (lo[:, kj] <= hi[:, qi])",
           ("tests/test_packed_attention.py",),
           "packed attention skips a key block whose last sequence runs on into the query block (issue 39)"),
    Mutant("padding-leaves-out-padding-rows", "data", "cfp/data/breakdown.py",
           '"pad_slots": lay.slots - real}',
           '"pad_slots": lay.width * len(lay.rows) - real}',
           ("tests/test_data_rows.py",),
           "the padding counted leaves out the rows a micro-batch's power-of-two row count adds"),
    Mutant("layout-rows-not-rounded", "data", "cfp/data/rows.py",
           "return MicroBatchRows(width, tuple(tuple(r) for r in rows), row_count(len(rows)))",
           "return MicroBatchRows(width, tuple(tuple(r) for r in rows), len(rows))",
           ("tests/test_data_rows.py",),
           "micro-batches take any row count, so the shapes (and compiles) are no longer bounded"),
    Mutant("row-cost-prices-one-row", "data", "cfp/data/schemes.py",
           "self.b * lay.slots + self.c",
           "self.b * lay.width + self.c",
           ("tests/test_data_rows.py",),
           "a micro-batch's fitted cost charges one row's token slots, whatever its row count"),
    Mutant("breakdown-sync-from-own-end", "data", "cfp/data/breakdown.py",
           "idle=last - end, sync=_lag(seconds - last),",
           "idle=last - end, sync=_lag(seconds - end),",
           ("tests/test_data_rows.py",),
           "the step breakdown counts a pipeline's wait for the slowest one twice (as idle and as gradient sync)"),
    Mutant("row-packing-never-merges", "data", "cfp/data/packing.py",
           "            if gain > best:\n",
           "            if gain > best + 1.0:\n",
           ("tests/test_data_rows.py",),
           "fine-grained packing keeps each width's micro-batches apart even where one more micro-batch costs more "
           "than the attention a merge adds (the gain compared in the wrong unit)"),
    Mutant("merge-ignores-slot-limit", "data", "cfp/data/packing.py",
           "            if lay.slots > limit:\n                continue\n            c = scheme.layout_cost",
           "            if lay.slots > 2 * limit:\n                continue\n            c = scheme.layout_cost",
           ("tests/test_data_rows.py",),
           "merging micro-batches lets one exceed the scheme's slot limit (its memory budget)"),
    # ---- issue 28: one options record; every script exercised
    Mutant("autoshard-ignores-options", "options", "cfp/api.py",
           "sopts = (options or SearchOptions()).replace(progress=verbose,",
           "sopts = SearchOptions().replace(progress=verbose,",
           ("tests/test_options.py",),
           "cfp.autoshard drops the SearchOptions it is given and searches with the defaults"),
    Mutant("stage-search-ignores-options", "options", "cfp/runtime/stage/plans.py",
           "return self.search.replace(cache_dir=self.search.profile.cache_dir or default_cache_dir(), progress=False,",
           "return SearchOptions().replace(cache_dir=default_cache_dir(), progress=False,",
           ("tests/test_options.py",),
           "the stage planner searches every stage with the default options, whatever --stage-memory/--stage-profiler say"),
    Mutant("cli-flag-drops-given-value", "options", "cfp/cli/flags.py",
           "return {f.name: getattr(args, flag.replace(\"-\", \"_\")) for f, flag, _ in _flag_fields(record, prefix)",
           "return {f.name: getattr(record(), f.name) for f, flag, _ in _flag_fields(record, prefix)",
           ("tests/test_options.py",),
           "`cfp search` parses its flags but builds the options from the record's defaults"),
    Mutant("compare-ilp-cost-model-renamed", "scripts", "benchmarks/compare.py",
           "        cm = AlphaBeta()\n",
           "        cm = CostModel()\n",
           ("tests/test_scripts.py::test_script_runs_shrunk[benchmarks/compare.py-cpu]",),
           "benchmarks/compare.py's ILP row uses a name the ILP baseline renamed (issue 28's NameError)"),
    Mutant("xla-log-read-from-cached-programs", "search", "cfp/xla/log.py",
           "            with _descriptor_2_caught(caught, cache_off=known is None):\n",
           "            with _descriptor_2_caught(caught, cache_off=False):\n",
           ("tests/test_reshard.py::test_xla_log_read_also_when_the_persistent_cache_holds_the_program",),
           "a program JAX's persistent compilation cache holds is loaded, not compiled, so XLA logs nothing "
           "about it and cfp misses its involuntary rematerializations"),
    Mutant("xla-log-record-not-replayed", "search", "cfp/xla/log.py",
           "                text += known            # loaded from the cache: XLA's lines of when it was compiled\n",
           "                pass\n",
           ("tests/test_reshard.py::test_xla_log_read_also_when_the_persistent_cache_holds_the_program",),
           "a recorded program loaded from the persistent cache reports no rematerializations (its record unread)"),
    # ---- issue 29: fits rescaled by measured spans
    Mutant("step-priced-with-raw-fits", "data", "cfp/data/train.py",
           "    k, plan, est, per_pipe = plan_step(opts, scaled(candidates, factors or {}), lengths)\n",
           "    k, plan, est, per_pipe = plan_step(opts, candidates, lengths)\n",
           ("tests/test_data_train.py::test_run_matches_sequence_by_sequence_reference",),
           "cfp data train learns each scheme's factor but prices every step with the fits as measured"),
    Mutant("rescale-factor-undamped", "data", "cfp/data/rescale.py",
           "        f = out.get(k, 1.0) * float(np.median(r)) ** DAMPING\n",
           "        f = out.get(k, 1.0) * float(np.median(r))\n",
           ("tests/test_data_rescale.py",),
           "one noisy step sets a scheme's factor outright instead of moving it half-way"),
    Mutant("rescale-counts-idle-pipelines", "data", "cfp/data/rescale.py",
           "        if t.span > 0 and t.estimated_span > 0 and np.isfinite(t.span / t.estimated_span):\n",
           "        if t.estimated_span > 0:\n",
           ("tests/test_data_rescale.py",),
           "a pipeline that computed nothing (span 0) drags its scheme's factor toward the lower bound"),
    Mutant("cpu-counts-compiling", "data", "cfp/data/train.py",
           "    trainer.warm(mbs)                 # compiles new shapes outside the timed step\n    c0 = time.process_time()\n",
           "    c0 = time.process_time()\n    trainer.warm(mbs)                 # compiles new shapes outside the timed step\n",
           ("tests/test_data_train.py::test_run_matches_sequence_by_sequence_reference",),
           "a step's CPU seconds (cores busy) take in the compiling its warm-up does outside the timed step"),
    Mutant("space-reused-across-row-limits", "data", "cfp/data/schemes.py",
           "                and self.max_seq_len == max_seq_len)\n",
           "                and (self.max_seq_len or 0) <= max_seq_len)\n",
           ("tests/test_data_space_reuse.py",),
           "a scheme space measured for shorter rows is reused for longer ones, whose sequences then fit no scheme"),
    Mutant("warm-keyed-by-stages", "runtime", "cfp/runtime/engine.py",
           "                key = (self.run_layout, p, str(jax.tree_util.tree_structure(mb)),\n",
           "                key = (self.run_layout.pipelines[p].stages, str(jax.tree_util.tree_structure(mb)),\n",
           ("tests/test_data_switch.py::test_warm_leaves_nothing_to_compile_after_a_switch_into_stages_warmed_elsewhere",),
           "shapes warmed under one layout count as warmed in another with the same stages: its step compiles"),
    Mutant("resumed-run-searches-its-plans-again", "stage plans", "cfp/runtime/stage/plan_sources.py",
           "        reused = _reusable(saved, request) if request.resume and saved else None\n",
           "        reused = None\n",
           ("tests/test_stage_plans.py::test_resumed_run_keeps_its_stage_plans",),
           "a resumed run searches its stage plans again instead of reusing those saved beside its checkpoints"),
    # ---- issue 27: the activations a schedule keeps
    Mutant("executor-keeps-forward-inputs", "runtime", "cfp/runtime/executor.py",
           "        kept = self.saved.pop((key, m))\n",
           "        kept = self.saved[(key, m)]\n",
           ("tests/test_runtime.py::test_matches_single_device_gpipe_and_1f1b",),
           "the dispatcher never frees a micro-batch's kept input after its backward (1F1B keeps GPipe's memory)"),
    Mutant("schedule-kept-ignores-stash", "schedules", "cfp/schedules/actions.py",
           "        return kept.weight[c] - kept.inputs[c]\n",
           "        return 0.0\n",
           ("tests/test_runtime.py::test_matches_single_device_gpipe_and_1f1b",),
           "the schedule's memory model keeps B's input but not the output gradient W needs"),
    Mutant("vstage-chunk-on-wrong-device", "runtime", "cfp/runtime/vstages.py",
           "for d, n in zip(placement, layers))",
           "for d, n in zip(sorted(placement), layers))",
           ("tests/test_virtual_stages.py",),
           "virtual stages are put on the stages in pipeline order (chunk c on stage c // v), not where the "
           "schedule places them"),
    Mutant("kept-predicted-from-the-pattern", "runtime", "cfp/runtime/engine.py",
           "for s, peak in enumerate(peak_kept(self.table(p), kept)):",
           "for s, peak in enumerate(peak_kept(self.spec.entry(self.layout.pipelines[p].num_stages, "
           "self.layout.pipelines[p].chunks, self.spec.v), kept)):",
           ("tests/test_virtual_stages.py::test_a_generated_table_trains_like_one_device_within_the_patterns_memory",),
           "the kept-activation prediction is the fixed pattern's while the pipeline runs a generated table"),
    Mutant("generated-table-beyond-the-patterns-memory", "runtime", "cfp/runtime/engine.py",
           "                                               peak_kept(pattern, kept), kept)",
           "                                               [1e30] * pipe.num_stages, kept)",
           ("tests/test_virtual_stages.py::test_a_generated_table_trains_like_one_device_within_the_patterns_memory",),
           "the table generated from measured times may keep more activations per device than the fixed pattern"),
    # ---- issue 41: a data loader's batches, the cluster's launcher
    Mutant("list-of-batches-taken-as-one-batch", "runtime", "cfp/runtime/feed.py",
           "return _Listed(items)", "return _Rows(tuple(items))",
           ("tests/test_feed.py::test_per_step_batches_train_like_the_models_own_step",),
           "a list of per-step batches (what a data loader yields) is taken as one batch"),
    Mutant("launcher-process-id-ignored", "runtime", "cfp/runtime/launch.py",
           "process_id=job.process_id,", "process_id=0,",
           ("tests/test_launch.py::test_launcher_job_arguments",),
           "the process id the cluster's launcher set is ignored: every process joins as process 0"),
    Mutant("local-device-ids-from-the-global-rank", "runtime", "cfp/runtime/launchers.py",
           '"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),', '"SLURM_PROCID", "SLURM_NTASKS", "SLURM_PROCID"),',
           ("tests/test_launch.py::test_local_device_ids_and_devices_per_process",),
           "a process's local device ids are taken from its global rank (SLURM_PROCID), not its node-local one"),
    # ---- issue 38: compute once (kept residuals, B and W without recomputation)
    Mutant("w-recomputes-the-forward", "runtime", "cfp/ir/backward_split.py",
           "    b = b0 | {e for e in w0 if eqn_kind[e] is Kind.FORWARD}          # W recomputes no forward value\n",
           "    b = b0\n",
           ("tests/test_compute_once.py",),
           "W recomputes the forward values it reads that F did not keep (full, selective) instead of B handing them"),
    Mutant("b-drops-a-residual-w-needs", "runtime", "cfp/runtime/stage/kept.py",
           "        return Kept(kept.sig, tuple(res[i] for i in split.w_residuals)",
           "        return Kept(kept.sig, tuple(res[i] for i in split.w_residuals[1:])",
           ("tests/test_runtime.py::test_matches_single_device_gpipe_and_1f1b",),
           "B keeps for W one residual fewer than W reads"),
    Mutant("residuals-kept-after-w", "runtime", "cfp/runtime/executor.py",
           "        acc, done = prog.backward_weight(self.params[key], self.kept.pop((key, m)), self._batch(a, prog),\n",
           "        acc, done = prog.backward_weight(self.params[key], self.kept[(key, m)], self._batch(a, prog),\n",
           ("tests/test_runtime.py::test_matches_single_device_gpipe_and_1f1b",),
           "the dispatcher keeps a micro-batch's residuals and handoff after its W ran"),
    Mutant("serial-pass-runs-side-by-side", "runtime", "cfp/runtime/executor.py",
           "                    jax.block_until_ready(done)\n                    self.clock.alone(",
           "                    self.clock.alone(",
           ("tests/test_serial_measure.py",),
           "a serial measuring pass does not wait for each action: its times are its dispatches'"),
    Mutant("serial-passes-keep-the-longest", "runtime", "cfp/runtime/measured_tables.py",
           "            if k not in best or e.end - e.start < best[k].end - best[k].start:\n",
           "            if k not in best or e.end - e.start > best[k].end - best[k].start:\n",
           ("tests/test_serial_measure.py",),
           "of several serial passes each action's longest time is kept: a preempted action sets its stage's median"),
    Mutant("makespan-from-shared-core-times", "runtime", "cfp/runtime/training.py",
           "        if serial is None or not any(e.pipeline == q for e in serial):\n",
           "        if True:\n",
           ("tests/test_serial_measure.py",),
           "the simulated makespan priced from actions timed side by side on shared cores, not one at a time"),
    Mutant("pipelines-schedules-swapped", "runtime", "cfp/runtime/vstages.py",
           "        return tuple(ScheduleSpec.parse(s) for s in specs)\n",
           "        return tuple(ScheduleSpec.parse(s) for s in specs)[::-1]\n",
           ("tests/test_pipeline_schedules.py",),
           "two pipelines' schedules swapped: each runs the other's table"),
    Mutant("forward-keeps-parameter-copies", "runtime", "cfp/ir/backward_split.py",
           "    kept = {v for v, k in var_kind.items() if k is Kind.FORWARD and v in producer\n",
           "    kept = {v for v, k in var_kind.items() if k is not Kind.BACKWARD and v in producer\n",
           ("tests/test_compute_once.py::test_w_runs_no_forward_and_residuals_hold_no_parameters",),
           "F keeps values computed from the parameters alone (a copy of them per micro-batch)"),
    # ---- issue 42: autoshard held to the layouts users write, resharding priced by latency and bandwidth
    Mutant("plain-fsdp-candidate-left-out", "search", "cfp/baselines/user_layouts.py",
           "USER_LAYOUTS = (Layout.DATA_PARALLEL, Layout.FSDP, Layout.DP_TP)",
           "USER_LAYOUTS = (Layout.DATA_PARALLEL, Layout.DP_TP)",
           ("tests/test_user_layouts.py",),
           "the search no longer verifies plain FSDP (in/out shardings alone), so a slower plan can win"),
    Mutant("resharding-latency-dropped", "search", "cfp/hardware/alpha_beta.py",
           "        return self.a0 + self.a1 * (n - 1) + wire_factor(kind, n) * nbytes / self.bandwidth",
           "        return wire_factor(kind, n) * nbytes / self.bandwidth",
           ("tests/test_alpha_beta.py",),
           "resharding priced by bandwidth alone: many small reshards look as cheap as one collective"),
    Mutant("returned-plan-over-the-budget", "search", "cfp/search/search.py",
           "    return budget is None or memory <= budget",
           "    return budget is None or memory <= 2 * budget",
           ("tests/test_user_layouts.py",),
           "a candidate over the memory budget is timed and can be returned"),
    Mutant("budget-fraction-of-cfp-data-parallel", "search", "cfp/search/search.py",
           "    step = steps.layout_step(Layout.DATA_PARALLEL, shardings)\n",
           "    step = steps.step(data_parallel_choice(analysis.graph, analysis.blocks))\n",
           ("tests/test_user_layouts.py",),
           "budget_fraction takes its fraction of cfp's constrained data parallel (in the demo 7.4 MB, not plain "
           "data parallel's 17.3 MB): a budget far below what the user asked for"),
    Mutant("alpha-beta-fit-keeps-negative-bandwidth", "search", "cfp/hardware/alpha_beta.py",
           "            drop = [c for c in neg if c != 2] or neg\n",
           "            drop = [c for c in neg if c != 2]\n",
           ("tests/test_alpha_beta.py",),
           "a fit whose bandwidth term alone comes out negative (a loaded host) never ends: autoshard hangs"),
    # ---- issue 39: packed attention computes only the blocks it keeps, and the breakdown prices those
    Mutant("block-map-off-by-one-block", "data", "cfp/models/packed_attention.py",
           "    return np.tril_indices(n, -1)",
           "    return np.tril_indices(n, -2)",
           ("tests/test_packed_attention.py",),
           "the block map's pairs start one block below the diagonal: a query block never sees the block before it"),
    Mutant("breakdown-counts-every-block", "data", "cfp/models/packed_attention.py",
           "    all_pairs = computes_all_pairs(num_rows, n)",
           "    all_pairs = True",
           ("tests/test_packed_attention.py",),
           "the breakdown and fits count every block up to the diagonal, which the kernel no longer computes"),
    # ---- issues 38 and 40 (planner): recompute priced per stage as the runtime runs it
    Mutant("planner-prices-none-with-recomputed-forward", "planner", "cfp/planner/step_features.py",
           "    return 3 if policy is Recompute.FULL else 2",
           "    return 3",
           ("tests/test_planner_recompute.py",),
           "a stage that keeps its residuals is priced as if its backward reran the forward"),
    # ---- issue 40 items 2 and 4 (planner): stage memory per pipeline, a measured host entry
    Mutant("planner-charges-optimizer-state-to-every-pipeline", "planner", "cfp/planner/step_features.py",
           "GradSync.GATHER and not place.updates and place.n > 1:",
           "GradSync.GATHER and False:",
           ("tests/test_pipeline_memory.py",),
           "pipeline 0's optimizer state charged to another pipeline's stages, which hold none"),
    Mutant("host-cache-keyed-without-cores", "hardware", "cfp/hardware/host_entry.py",
           '    return {"cpu": cpu_model(), "cores": host_cores(), "jax": jax.__version__}',
           '    return {"cpu": cpu_model(), "jax": jax.__version__}',
           ("tests/test_host_entry.py",),
           "the calibration cache keyed without the core count: a process given fewer cores reuses another's figures"),
    Mutant("host-entry-never-reused", "hardware", "cfp/hardware/host_entry.py",
           "        hit = _read(path, key)",
           "        hit = None",
           ("tests/test_host_entry.py",),
           "every plan measures the host again instead of reusing its cached figures"),
    Mutant("host-recalibrate-ignored", "hardware", "cfp/hardware/host_entry.py",
           "    if not recalibrate:",
           "    if True:",
           ("tests/test_host_entry.py",),
           "--recalibrate reuses the cached figures instead of measuring again"),
    Mutant("host-fallback-unnamed", "hardware", "cfp/hardware/host_entry.py",
           '        return f"catalog cpu entry (cfp/hardware/cpu_calibration.py; {self.reason})"',
           '        return "cpu entry"',
           ("tests/test_host_entry.py",),
           "an estimate priced by the catalog's fallback entry does not say so (nor why)"),
    Mutant("planner-syncs-on-every-pipeline", "planner", "cfp/planner/costmodel.py",
           "        for p, f in zip(layout.pipelines[:1], figs[:1]):",
           "        for p, f in zip(layout.pipelines, figs):",
           ("tests/test_pipeline_memory.py",),
           "the gradient sync priced on every pipeline's stages, though only pipeline 0's gather"),
    # ---- issue 40 item 1: planning time -- each memo key holds all its figure depends on
    Mutant("planner-stage-figures-memo-ignores-place", "planner", "cfp/planner/costmodel.py",
           'key = ("stage_estimates", shape, pipe.batch, pipe.chunks, n_pipes, spec)',
           'key = ("stage_estimates", shape, pipe.batch, pipe.chunks, spec)',
           ("tests/test_planner_memo.py",),
           "a pipeline's stage figures memoised without its place: another pipeline's are priced as pipeline 0's"),
    Mutant("planner-stage-memo-key-misread", "planner", "cfp/planner/costmodel.py",
           "links[i] if i + 1 < n else -1.0)",
           "links[i - 1] if i else -1.0)",
           ("tests/test_planner_memo.py",),
           "the per-stage memo looked up with the link into the stage, not out of it: another stage's send"),
    Mutant("planner-order-token-ignores-links", "planner", "cfp/planner/build.py",
           "           tuple(a.machine == b.machine for a, b in zip(order, order[1:])))",
           "           ())",
           ("tests/test_planner_memo.py",),
           "stage orders interned without which neighbours share a machine: a split behind a slow link reused"),
    Mutant("planner-sync-memo-by-pipeline-count", "planner", "cfp/planner/costmodel.py",
           'tokens = ("narrowest", tuple(f.tp_token for f in figs))',
           'tokens = ("narrowest", len(figs))',
           ("tests/test_planner_memo.py",),
           "the gradient sync's narrowest TP degrees memoised by pipeline count: another layout's layer bounds"),
    Mutant("planner-policy-peak-of-the-first-policy", "planner", "cfp/planner/costmodel.py",
           "            hit = self._memo[key] = (p, peak)",
           "            hit = self._memo[key] = (p, self._peak_bytes(st, idx, pipe, n_pipes, spec, options[0]))",
           ("tests/test_planner_memo.py",),
           "a stage's memory memoised with its policy is the least-recompute policy's peak, not the chosen one's"),
    # ---- issue 43 (tests past the listed cases): optax wrappers through the optimizer partition
    Mutant("optax-wrapper-finite-any-stage", "runtime", "cfp/runtime/optimizer/update_plan.py",
           '"and": jnp.logical_and, "or": jnp.logical_or}',
           '"and": jnp.logical_or, "or": jnp.logical_or}',
           ("tests/test_optax_wrappers.py",),
           "apply_if_finite's all-finite is combined across stages with or: one stage's finite gradient applies "
           "another stage's non-finite one"),
    Mutant("engine-raises-on-rejected-gradient", "runtime", "cfp/runtime/engine.py",
           "            if ok[1].all():\n",
           "            if ok.all():\n",
           ("tests/test_optax_wrappers.py",),
           "a non-finite gradient the user's optimizer rejects (apply_if_finite, skip_not_finite) stops the run"),
    # ---- issue 41 (second part): each process feeds its own share; cfp data train joins the launcher's job
    Mutant("share-ignores-the-last-stage", "runtime", "cfp/runtime/feed.py",
           "for st in (pipe.stages[0], pipe.stages[-1]) for d in st.devices",
           "for st in (pipe.stages[0],) for d in st.devices",
           ("tests/test_feed_share.py",),
           "a process feeds only the pipelines whose first stage it hosts, not those whose last stage (the labels)"),
    Mutant("share-placed-at-the-first-rows", "runtime", "cfp/runtime/feed.py",
           "            out[self.indices] = a\n", "            out[:len(a)] = a\n",
           ("tests/test_feed_share.py",),
           "a process's share is placed at the global batch's first rows, not at its pipelines' rows"),
    Mutant("replay-gathers-process-0s-rows", "runtime", "cfp/runtime/feed.py",
           "g[owner, rows]", "g[0, rows]",
           ("tests/test_feed_share.py",),
           "verify's whole batch takes every row from process 0, also the rows only another process feeds"),
    Mutant("share-agreement-unchecked", "runtime", "cfp/runtime/feed.py",
           "odd = [p for p in range(len(every))", "odd = [p for p in range(0)",
           ("tests/test_feed_share.py",),
           "processes feeding batches of other dims at a step are not stopped (each derives the others' shapes)"),
    Mutant("data-train-skips-the-join", "runtime", "cfp/cli/data.py",
           "    maybe_initialize_distributed()  # before any device use: the job of",
           "    pass  # before any device use: the job of",
           ("tests/test_feed_share.py",),
           "cfp data train does not join the launcher's job (each process would train alone)"),
    # issue 41: a clique's first collective (gloo builds its connections with a fixed 30 s deadline for every peer)
    Mutant("first-move-not-met", "runtime", "cfp/runtime/comm.py",
           "    meet_before_first_collective([src, dst], ready=arrays)",
           "    (lambda *a, **k: None)([src, dst], ready=arrays)",
           ("tests/test_first_collective.py",),
           "the two processes of a stage hop enter its first transfer unsynchronised (late by > 30 s: gloo fails)"),
    Mutant("first-gather-not-met", "runtime", "cfp/runtime/host_state.py",
           "        meet_before_first_collective(jax.devices())\n    for key in keys:",
           "        pass\n    for key in keys:",
           ("tests/test_first_collective.py",),
           "the processes enter the first gather of stage trees unsynchronised (late by > 30 s: gloo fails)"),
    Mutant("first-collective-keyed-by-the-set", "runtime", "cfp/runtime/cliques.py",
           "    ids = tuple(d.id for d in devices)      # in order",
           "    ids = tuple(sorted(d.id for d in devices))      # in order",
           ("tests/test_first_collective.py",),
           "a move back along a stage hop is taken as met (gloo builds a context per device order: it can time out)"),
    Mutant("rank-lines-written-apart", "runtime", "cfp/runtime/launch.py",
           "            stream.reconfigure(line_buffering=True, write_through=False)",
           "            stream.reconfigure(line_buffering=True, write_through=True)",
           ("tests/test_launch.py::test_a_printed_line_reaches_the_launcher_in_one_write",),
           "a printed line's text and newline are two writes: under mpirun another rank's line lands between them"),
    Mutant("data-factors-not-agreed", "data", "cfp/data/train.py",
           "    return agreed(new, candidates) if jax.process_count() > 1 else new",
           "    return new",
           ("tests/test_data_rescale.py",),
           "each process prices the next step by its own pipelines' spans: processes may choose different mixes"),
    # ---- issue 43 item 1: schedule generator and timeline statistics, caught by properties (hypothesis)
    Mutant("generator-keeps-a-longer-policy", "schedules", "cfp/schedules/generate.py",
           "sim.makespan < best[1].makespan * (1 - 1e-12)",
           "sim.makespan > best[1].makespan * (1 - 1e-12)",
           ("tests/test_properties_schedules.py",),
           "the generator keeps a policy's table longer than the fixed pattern it was seeded with"),
    Mutant("improve-swaps-past-memory", "schedules", "cfp/schedules/generate.py",
           "if peak > limit[d] * (1 + 1e-9):",
           "if peak > limit[d] * 1.5:",
           ("tests/test_properties_schedules.py",),
           "the hill-climb keeps swaps that take a stage over its memory limit"),
    Mutant("timeline-mean-for-median", "runtime", "cfp/runtime/timeline.py",
           "row.append(statistics.median(d) if d else 0.0)",
           "row.append(statistics.mean(d) if d else 0.0)",
           ("tests/test_properties_timeline.py",),
           "the per-stage action seconds are means: one stalled action moves the generated tables"),
    Mutant("timeline-whole-backward-not-a-b", "runtime", "cfp/runtime/timeline.py",
           "for phases in ((Phase.FWD,), (Phase.BWD_INPUT, Phase.BWD), (Phase.BWD_WEIGHT,)):",
           "for phases in ((Phase.FWD,), (Phase.BWD_INPUT,), (Phase.BWD_WEIGHT,)):",
           ("tests/test_properties_timeline.py",),
           "a whole backward's time is left out of its stage's B median (GPipe/1F1B stages get B = 0)"),
    Mutant("median-costs-over-all-pipelines", "runtime", "cfp/runtime/measured_tables.py",
           "median_action_seconds([e for e in events if e.pipeline == pipeline], num_vstages)",
           "median_action_seconds(list(events), num_vstages)",
           ("tests/test_properties_timeline.py",),
           "a pipeline's medians are taken over every pipeline's actions: a fast pipeline gets a slow one's times"),
    # ---- issue 43 item 2: sizes past one digit
    Mutant("frontend-layers-sorted-as-text", "layered", "cfp/layered/frontends.py",
           "                  key=lambda k: int(k[len(name) + 1:]))",
           "                  key=str)",
           ("tests/test_sizes_frontends.py::test_twelve_layers_train_like_the_users_own_step[linen-layers_i]",),
           "a Linen model's layers_0 .. layers_11 run in text order (layers_10 after layers_1)"),
    Mutant("checkpoint-steps-sorted-as-text", "runtime", "cfp/runtime/checkpoint.py",
           "    return sorted(steps)\n",
           "    return sorted(steps, key=str)\n",
           ("tests/test_sizes.py::test_checkpoint_steps_past_9_and_99",),
           "checkpoint steps ordered as text: a run resumes from step 9 although step 10 was saved"),
    Mutant("batch-offsets-by-micro-batch", "runtime", "cfp/layout.py",
           "            off += p.batch\n",
           "            off += p.micro_batch\n",
           ("tests/test_sizes.py::test_twelve_pipelines_get_their_own_rows_and_order",),
           "a pipeline's rows start after the earlier pipelines' micro-batches, not their batches: rows fed twice"),
    # ---- issue 39 item 4: assignment at the scale of the largest steps (fast paths)
    Mutant("lpt-first-round-drops-a-sequence", "data", "cfp/data/packing.py",
           "got = _lpt_rest(ordered[k:].tolist(),",
           "got = _lpt_rest(ordered[k + 1:].tolist(),",
           ("tests/test_assign_fast.py",),
           "the packing greedy's vectorised first round hands the loop its sequences less the next one"),
    Mutant("first-fit-running-max-not-lowered", "data", "cfp/data/packing.py",
           "        if v == best[k]:",
           "        if v <= best[k]:",
           ("tests/test_assign_fast.py",),
           "first-fit's running maximum of the rooms is not lowered after a placement: sequences go to full "
           "micro-batches"),
    Mutant("dispatch-first-sequence-pays-no-bubble", "data", "cfp/data/dispatch.py",
           "replace(heap, (load + x * mul, p, 1))",
           "replace(heap, (load + x, p, 1))",
           ("tests/test_assign_fast.py",),
           "the dispatch's one-kind run forgets that a pipeline's first sequence also pays the (pp-1) bubble"),
    # ---- issue 39 item 2: the attention implementation chosen in one place
    Mutant("attention-cudnn-head-dim-256-before-hopper", "models", "cfp/models/attention_select.py",
           "head_max = 256 if cc >= HOPPER else 128",
           "head_max = 256",
           ("tests/test_attention_select.py",),
           "the GPU selection takes cuDNN's fused path for head dims over 128 on GPUs before Hopper, which it "
           "does not support"),
    Mutant("planner-prices-scores-where-the-runtime-fuses", "planner", "cfp/planner/step_features.py",
           "        return runtime_fuses_attention(config, cluster)",
           "        return False",
           ("tests/test_planner_attention.py",),
           "the planner prices materialised attention scores on GPUs where the runtime runs cuDNN's fused "
           "attention"),
    Mutant("planner-attention-from-the-first-gpu-only", "planner", "cfp/planner/step_features.py",
           "    return decide_for(kinds, config_case(config, packed=False)).impl is Impl.CUDNN",
           "    return decide_for(kinds[:1], config_case(config, packed=False)).impl is Impl.CUDNN",
           ("tests/test_planner_attention.py",),
           "the planner prices fused attention on a cluster whose other GPUs the runtime runs dense (one program "
           "for all of them)"),
    Mutant("attention-header-from-the-parameter-dtype", "models", "cfp/models/attention_select.py",
           "    return AttentionCase(config.dtype, config.seq_len,",
           "    return AttentionCase(\"float32\", config.seq_len,",
           ("tests/test_attention_select.py", "tests/test_planner_attention.py"),
           "the run header (and the planner) decide for float32 rows while the zoo runs the compute dtype: the "
           "header names the dense path where cuDNN's fused attention runs"),
    Mutant("zoo-attention-ignores-the-devices", "models", "cfp/models/attention_select.py",
           "    impl = decide_for(current_kinds(), case_of(q, v, causal, segment_ids)).impl",
           "    impl = decide_for((XLA_DEVICE,), case_of(q, v, causal, segment_ids)).impl",
           ("tests/test_attention_select.py",),
           "the zoo's attention never takes the fused path on a GPU that supports it (the header says cudnn)"),
    Mutant("train-header-unpacked-for-packed-batches", "runtime", "cfp/runtime/training.py",
           "    log(header_line(job.model.config, packed))",
           "    log(header_line(job.model.config, not packed))",
           ("tests/test_virtual_stages.py::test_a_run_measures_its_stages_then_trains_on_the_generated_table",),
           "cfp train's header names the packed kernel for rows without segment ids (another implementation "
           "than the one its stages run)"),
    Mutant("data-train-header-unpacked", "data", "cfp/data/train.py",
           "        log(header_line(trainer.model.config, packed=True))",
           "        log(header_line(trainer.model.config, packed=False))",
           ("tests/test_data_cli.py::test_data_train_runs_hydraulis_mixes_and_verifies",),
           "cfp data train's header names the dense path while its packed rows run the block kernel"),
)


def _copy_repo(dest: str) -> None:
    """Tracked and untracked non-ignored files of the repository (not .git, caches or virtual environments);
    outside a git checkout, the whole tree less those."""
    try:
        out = subprocess.run(["git", "-C", ROOT, "ls-files", "-co", "--exclude-standard", "-z"], check=True,
                             capture_output=True).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        shutil.copytree(ROOT, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
            ".git", "__pycache__", ".venv", "*.egg-info", ".pytest_cache"))
        return
    for rel in filter(None, out.split("\0")):
        src = os.path.join(ROOT, rel)
        if not os.path.isfile(src):
            continue
        dst = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy2(src, dst)


def _apply(m: Mutant, dest: str) -> str | None:
    """Apply the mutant in the copy; an error message if its text is not found exactly once."""
    path = os.path.join(dest, m.file)
    if not os.path.isfile(path):
        return f"{m.file} does not exist"
    with open(path) as f:
        text = f.read()
    count = text.count(m.old)
    if count != 1:
        return f"patch text found {count} times in {m.file}"
    with open(path, "w") as f:
        f.write(text.replace(m.old, m.new))
    return None


_FAILED = re.compile(r"^(FAILED|ERROR) (\S+)", re.M)


def _run_tests(tests: tuple[str, ...], dest: str, timeout: float) -> tuple[int, str]:
    env = dict(os.environ, PYTHONPATH=dest, PYTHONDONTWRITEBYTECODE="1")
    if env.get("JAX_COMPILATION_CACHE_DIR"):   # mutated code must not write the records other runs read
        env["JAX_COMPILATION_CACHE_DIR"] = os.path.join(dest, ".jax-cache")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
    try:
        p = subprocess.run(cmd, cwd=dest, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, "timed out"
    return p.returncode, p.stdout + p.stderr


def _verdict(rc: int, out: str) -> tuple[str, bool]:
    """(result text, caught?) of a mutated run."""
    if rc == 0:
        return "SURVIVED", False
    if rc == 1:
        m = _FAILED.search(out)
        return (f"caught by {m.group(2)}" if m else "caught (a test failed)"), True
    if rc == -1:
        return "ERROR: tests timed out", False
    last = [line for line in out.strip().splitlines() if line.strip()][-1:] or [""]
    return f"ERROR: pytest exit {rc} ({last[0][:80]})", False


def run_mutant(m: Mutant, timeout: float, baseline: bool) -> tuple[Mutant, str, bool, float]:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"cfp-mutant-{m.name}-") as dest:
        _copy_repo(dest)
        if baseline:
            rc, out = _run_tests(m.tests, dest, timeout)
            if rc != 0:
                return m, f"ERROR: unmutated tests fail ({_verdict(rc, out)[0]})", False, time.perf_counter() - t0
        err = _apply(m, dest)
        if err:
            return m, f"ERROR: patch failed ({err})", False, time.perf_counter() - t0
        result, caught = _verdict(*_run_tests(m.tests, dest, timeout))
    return m, result, caught, time.perf_counter() - t0


def _table(rows) -> str:
    head = ("mutant", "area", "file", "tests run", "result", "time (measured)")
    body = [(m.name, m.area, m.file, " ".join(t.replace("tests/", "") for t in m.tests), res, f"{secs:.0f} s")
            for m, res, _, secs in rows]
    widths = [max(len(r[i]) for r in (head, *body)) for i in range(len(head))]
    fmt = lambda r: " | ".join(c.ljust(w) for c, w in zip(r, widths))
    return "\n".join([fmt(head), "-+-".join("-" * w for w in widths), *map(fmt, body)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run these mutants only")
    ap.add_argument("--list", action="store_true", help="print the mutants and exit")
    ap.add_argument("--jobs", type=int, default=1, help="mutants run at once (default 1)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per mutant's tests (default 1800)")
    ap.add_argument("--tests", nargs="+", metavar="TEST",
                    help="run these test files or node ids instead of each mutant's own (to see what else catches it)")
    ap.add_argument("--baseline", action="store_true",
                    help="run each mutant's tests unmutated first (an error if they fail)")
    args = ap.parse_args(argv)
    names = {m.name for m in MUTANTS}
    if args.only:
        unknown = [n for n in args.only if n not in names]
        if unknown:
            ap.error(f"unknown mutant(s) {', '.join(unknown)}; valid: {', '.join(sorted(names))}")
    if args.jobs < 1:
        ap.error(f"--jobs {args.jobs} must be >= 1")
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    if args.tests:
        chosen = [dataclasses.replace(m, tests=tuple(args.tests)) for m in chosen]
    if args.list:
        for m in chosen:
            print(f"{m.name:32} {m.area:12} {m.file:30} {m.bug}")
        return 0
    print(f"{len(chosen)} mutants, {args.jobs} at a time; times are measured wall seconds", flush=True)
    rows = []
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run_mutant, m, args.timeout, args.baseline) for m in chosen]
        for f in concurrent.futures.as_completed(futures):
            m, res, caught, secs = f.result()
            print(f"  {m.name}: {res} ({secs:.0f} s)", flush=True)
            rows.append(f.result())
    rows.sort(key=lambda r: chosen.index(r[0]))
    print(_table(rows))
    caught = sum(1 for r in rows if r[2])
    print(f"{caught} of {len(rows)} mutants caught")
    return 0 if caught == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
