"""One pipeline stage: how it is built (the Megatron rules table or a searched plan), compiled (one
`CompileCache` the engine owns), timed and compared. One job per module:

* `program`  -- `StageProgram`: a stage's jitted fwd / bwd / update on its <CP,TP> sub-mesh;
* `replay`   -- `stage_step` (a stage's training step as the CFP passes see it) and `StageReplay` (the
  runtime's programs cut from it under a searched choice);
* `cache`    -- `CompileCache`: programs, analysed steps and replays, each built once;
* `cases`    -- every stage of a layout with its activation shapes, and its analysed step;
* `builder`  -- a stage's program from the rules or a plan;
* `plan_sources` -- where a training run's plans come from (`PLAN_SOURCES`: rules table, saved, searched);
* `plan_search` -- the per-stage CFP search; `boundary` -- its boundary-transfer pricing;
* `optim`    -- a stage's share of the optimizer; `activations` -- activations between stages as pytrees;
* `compare`  -- the searched plan against Megatron, side by side;
* `plans`    -- the records: `StagePlanOptions`, `StagePlan`, `StagePlans` (saved as JSON).
"""
from cfp.runtime.stage.cache import CompileCache as CompileCache
from cfp.runtime.stage.plans import StagePlan as StagePlan
from cfp.runtime.stage.plans import StagePlanMode as StagePlanMode
from cfp.runtime.stage.plans import StagePlanOptions as StagePlanOptions
from cfp.runtime.stage.plans import StagePlans as StagePlans
from cfp.runtime.stage.program import StageProgram as StageProgram
