"""The cluster's own launchers (Slurm's ``srun``, Open MPI's ``mpirun``, a Kubernetes JobSet): whether this
process was started by one, as which process of how many, and which of its node's devices it drives.

`detect_job` reads the variables the launcher sets (the ones ``jax.distributed``'s cluster detection reads);
`cfp.runtime.launch.maybe_initialize_distributed` hands the job to ``jax.distributed.initialize`` with the
launcher's name as its ``cluster_detection_method``, so JAX finds the coordinator itself (Slurm: the first node
of the step; Open MPI: mpirun's host), and passes the process's devices as ``local_device_ids``: JAX's default
there is one device per process (jax#16788), `local_device_ids` gives ``CFP_DEVICES_PER_PROC`` of them.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Optional

from cfp.errors import ConfigError

ENV_DEVICES_PER_PROC = "CFP_DEVICES_PER_PROC"
_DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


@dataclasses.dataclass(frozen=True)
class Launcher:
    """A launcher's variables: present when all of ``marks`` are set; ``size`` None: JAX asks the cluster."""
    name: str                 # jax.distributed's cluster_detection_method ("" for auto-detection)
    marks: tuple[str, ...]
    rank: str
    size: Optional[str]
    local_rank: Optional[str]  # this process's rank on its node (None: one process per node)


LAUNCHERS = (
    # srun's task variables (an sbatch script outside srun has SLURM_JOB_ID but no SLURM_PROCID: one process)
    Launcher("slurm", ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"),
             "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    # Open MPI 4 (ORTE): mpirun's URI names the coordinator's host
    Launcher("ompi", ("OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                      "OMPI_COMM_WORLD_LOCAL_RANK"),
             "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    # a Kubernetes indexed Job (JobSet): one process per pod; JAX reads the job's size from the cluster's API
    Launcher("", ("KUBERNETES_SERVICE_HOST", "JOB_COMPLETION_INDEX"), "JOB_COMPLETION_INDEX", None, None),
)
_NAMES = {"slurm": "Slurm (srun)", "ompi": "Open MPI (mpirun)", "": "Kubernetes (indexed Job)"}


@dataclasses.dataclass(frozen=True)
class Job:
    """This process's place in a launcher's job. ``num_processes`` None: the cluster's API knows it."""
    launcher: Launcher
    process_id: int
    num_processes: Optional[int]
    local_rank: int

    @property
    def describe(self) -> str:
        of = f" of {self.num_processes}" if self.num_processes is not None else ""
        return f"process {self.process_id}{of} started by {_NAMES[self.launcher.name]}"


def _int(env: Mapping[str, str], var: str) -> int:
    raw = env[var]
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{var}={raw!r} (set by the launcher) is not an integer") from None
    if value < 0:
        raise ConfigError(f"{var}={raw!r} (set by the launcher) must be >= 0")
    return value


def detect_job(env: Mapping[str, str]) -> Optional[Job]:
    """The launcher's job this process belongs to, or None (no launcher, or a job of one process)."""
    for launcher in LAUNCHERS:
        if all(v in env for v in launcher.marks):
            pid = _int(env, launcher.rank)
            n = _int(env, launcher.size) if launcher.size else None
            if n is not None and not pid < n:
                raise ConfigError(f"{launcher.rank}={pid} is not below {launcher.size}={n}")
            local = _int(env, launcher.local_rank) if launcher.local_rank else 0
            return None if n == 1 else Job(launcher, pid, n, local)
    return None


def devices_per_process(env: Mapping[str, str]) -> int:
    """``CFP_DEVICES_PER_PROC``, else the ``--xla_force_host_platform_device_count`` of ``XLA_FLAGS``, else 1."""
    raw = env.get(ENV_DEVICES_PER_PROC)
    if raw is None:
        m = _DEVICE_COUNT.search(env.get("XLA_FLAGS", ""))
        return int(m.group(1)) if m else 1
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(f"{ENV_DEVICES_PER_PROC}={raw!r} must be a whole number of devices >= 1")
    return int(raw)


def local_device_ids(job: Job, devices: int, env: Mapping[str, str]) -> list[int]:
    """The ids, among the devices this process can see, of the ``devices`` it drives: all of them where the
    launcher gave it exactly its own (``CUDA_VISIBLE_DEVICES`` of ``devices`` entries, as Slurm's
    ``--gpus-per-task`` does), else its node-local rank's block of the node's devices."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and len([v for v in visible.split(",") if v.strip()]) == devices:
        return list(range(devices))
    return [job.local_rank * devices + i for i in range(devices)]
