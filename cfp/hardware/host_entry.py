"""This host's `cpu` device entry, measured on first use and cached per host.

The catalog's `cpu` entry (`cfp.hardware.gpus`, figures in `cfp/hardware/cpu_calibration.py`) was measured on
one host on one day; on another host its figures are off by whatever differs. So the planner's figures for this
host's XLA:CPU devices are measured (`cfp.hardware.host_measure`) the first time a plan needs them on a host,
said so, and cached under a key that identifies the host -- its CPU model, the cores this process may use
(`os.sched_getaffinity`) and the jax version: a change to any of them measures again -- in the user cache dir
(`CFP_CACHE_DIR`, else `$XDG_CACHE_HOME/cfp`, else `~/.cache/cfp`). Later plans reuse it; `recalibrate`
(`cfp plan --recalibrate`) measures again. The catalog entry is the documented fallback: used, and named as
the figures that priced the plan, when `CFP_CALIBRATE=0` or the measurement fails (a noisy host whose fit is not
positive, no writable cache dir -- then the measured figures are used uncached). GPU entries keep their
published figures.
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from cfp.hardware.calibration import CpuCalibration
from cfp.hardware.gpus import GpuSpec, cpu_spec
from cfp.hardware.host_measure import QUICK, Size, host_cores, measure

CACHE_ENV = "CFP_CACHE_DIR"
DISABLE_ENV = "CFP_CALIBRATE"        # "0": no measurement, the catalog's entry
FORMAT = 1                            # of the cache file; another format is measured again


@dataclass(frozen=True)
class HostFigures:
    """The figures of this host's devices and which they are: `measured` (the host entry, with its key and
    date) or the catalog's entry (`reason`: why the fallback)."""
    calibration: CpuCalibration
    measured: bool
    key: dict
    date: str = ""
    reason: str = ""
    seconds: float = 0.0        # measured CPU seconds of the measurement (0: none ran)

    @property
    def spec(self) -> GpuSpec:
        """The `cpu` device entry of these figures."""
        return cpu_spec(self.calibration)

    def describe(self) -> str:
        """One line naming the figures that price an estimate."""
        if self.measured:
            now = f", just now in {self.seconds:.0f} s of CPU" if self.seconds else ""
            return f"measured host entry ({key_text(self.key)}; measured {self.date}{now})"
        return f"catalog cpu entry (cfp/hardware/cpu_calibration.py; {self.reason})"


def cpu_model() -> str:
    """The host CPU's model name (`/proc/cpuinfo`; else the platform's processor string)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def host_key() -> dict:
    """What identifies the host's figures: CPU model, cores this process may use, jax version."""
    import jax
    return {"cpu": cpu_model(), "cores": host_cores(), "jax": jax.__version__}


def key_text(key: dict) -> str:
    return f"{key['cpu']}, {key['cores']} cores, jax {key['jax']}"


def cache_dir() -> Path:
    """`CFP_CACHE_DIR`, else `$XDG_CACHE_HOME/cfp`, else `~/.cache/cfp`."""
    given = os.environ.get(CACHE_ENV)
    if given:
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cfp"


def cache_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"host-{digest}.json"


def _catalog(key: dict, reason: str) -> HostFigures:
    from cfp.hardware.cpu_calibration import CPU
    return HostFigures(CPU, False, key, reason=reason)


def _read(path: Path, key: dict) -> Optional[HostFigures]:
    """The cached figures at `path` if they are this key's, in this format; else None (measured again)."""
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT or data.get("key") != key:
            return None
        return HostFigures(CpuCalibration(**data["calibration"]), True, key, date=data["date"])
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _write(path: Path, fig: HostFigures) -> None:
    from cfp.files import write_text_atomic
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(str(path), json.dumps({"format": FORMAT, "key": fig.key, "date": fig.date,
                                             "calibration": dataclasses.asdict(fig.calibration)}, indent=1))


def host_figures(recalibrate: bool = False, size: Size = QUICK, log: Optional[Callable[[str], None]] = None,
                 measure_fn: Optional[Callable[..., CpuCalibration]] = None) -> HostFigures:
    """This host's figures: cached under its key, else (or with `recalibrate`) measured at `size` and cached;
    the catalog's entry when `CFP_CALIBRATE=0` or the measurement fails (`HostFigures.reason` says which).
    `log` gets a line before a measurement and its figures (the measurement is said, never silent);
    `measure_fn`: the measurement (default `cfp.hardware.host_measure.measure`)."""
    key = host_key()
    if os.environ.get(DISABLE_ENV, "1").strip().lower() in ("0", "off", "no", "false"):
        return _catalog(key, f"{DISABLE_ENV}=0: measurement disabled")
    path = cache_path(key)
    if not recalibrate:
        hit = _read(path, key)
        if hit is not None:
            return hit
    say = log or (lambda s: None)
    say(f"measuring this host's devices for the planner ({key_text(key)}; once per host, cached in {path}) ...")
    c0 = time.process_time()
    try:
        cal = (measure_fn or measure)(size, say)
    except Exception as e:  # a noisy host's fit, a failing kernel: the documented fallback, named
        return _catalog(key, f"measurement failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    fig = HostFigures(cal, True, key, date=f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
                      seconds=time.process_time() - c0)
    say(f"measured in {fig.seconds:.1f} s of CPU time")
    try:
        _write(path, fig)
    except OSError as e:
        say(f"not cached ({path}: {e.strerror or e}); measured again next time")
    return fig
