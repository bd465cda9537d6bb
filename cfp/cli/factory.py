"""``--model module.path:factory`` / ``--model file.py:factory``: a user's model for `cfp plan` and `cfp train`.

The factory is called with no arguments and returns ``(model, batch, optimizer)``: a `cfp.LayeredModel`, the
training data and an optax ``GradientTransformation``. ``batch`` is one batch (a pytree of arrays with a
leading batch dim; step ``s`` then trains on rows ``s*B .. s*B+B-1`` of it, wrapping around, for a global batch
of ``B`` rows), a list or iterable of per-step batches (a generator, a data loader), or a callable
``batch(step, rows) -> pytree`` giving step ``step``'s global batch of ``rows`` rows (it must depend only on its
arguments, so a resumed run sees the same data); see `cfp.runtime.feed`.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any

from cfp.errors import ConfigError
from cfp.planner.layout_file import is_factory as is_factory
from cfp.runtime.user_model import UserModel as UserModel, cycled_rows as cycled_rows


def load_factory(spec: str) -> UserModel:
    """Import ``spec`` (``module.path:factory`` or ``path/to/file.py:factory``), call it and check what it
    returned; ConfigError (one line) naming what is wrong."""
    target, _, name = spec.rpartition(":")
    if not target or not name.isidentifier():
        raise ConfigError(f"--model {spec!r} must be module.path:factory or file.py:factory")
    module = _import(target, spec)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"--model {spec!r}: {target} has no callable {name!r}")
    try:
        out = fn()
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"--model {spec!r}: the factory raised {type(e).__name__}: "
                          f"{(str(e).splitlines() or [''])[0][:300]}") from e
    return _checked(out, spec)


def _import(target: str, spec: str):
    if target.endswith(".py"):
        path = os.path.abspath(target)
        if not os.path.isfile(path):
            raise ConfigError(f"--model {spec!r}: no file {target!r}")
        name = "_cfp_user_" + os.path.splitext(os.path.basename(path))[0]
        loader = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(loader)
        sys.modules[name] = module
        try:
            loader.loader.exec_module(module)
        except Exception as e:
            sys.modules.pop(name, None)
            raise ConfigError(f"--model {spec!r}: {target} does not import: {type(e).__name__}: "
                              f"{(str(e).splitlines() or [''])[0][:300]}") from e
        return module
    try:
        return importlib.import_module(target)
    except Exception as e:
        raise ConfigError(f"--model {spec!r}: module {target!r} does not import: {type(e).__name__}: "
                          f"{(str(e).splitlines() or [''])[0][:300]}") from e


def _checked(out: Any, spec: str) -> UserModel:
    import optax

    from cfp.layered.model import LayeredModel
    if not (isinstance(out, tuple) and len(out) == 3):
        raise ConfigError(f"--model {spec!r}: the factory returned {type(out).__name__}; it must return "
                          "(LayeredModel, batch, optax optimizer)")
    model, batch, tx = out
    if not isinstance(model, LayeredModel):
        raise ConfigError(f"--model {spec!r}: the factory's first value is {type(model).__name__}, not a "
                          "cfp.LayeredModel")
    if not isinstance(tx, optax.GradientTransformation):
        raise ConfigError(f"--model {spec!r}: the factory's third value is {type(tx).__name__}, not an optax "
                          "GradientTransformation")
    from cfp.runtime.feed import step_batches
    return UserModel(model, step_batches(batch, model, f"--model {spec!r}: the factory's batches"), tx, spec)
