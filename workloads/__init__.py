"""Built-in workloads and the loader for a user's own (see ``workloads.protocol``)."""

from __future__ import annotations

import importlib
import traceback

from raylastic.workloads.protocol import REQUIRED_METHODS, Workload

BUILTIN_WORKLOADS = {
    "digits": "raylastic.workloads.digits:Digits",
    "chargpt": "raylastic.workloads.chargpt:CharGPT",
    "gpt": "raylastic.workloads.gpt:TokenGPT",
}


def resolve_workload_class(name: str) -> type:
    """Return the class named by a built-in short name or a ``"pkg.module:ClassName"`` path.

    Raises ValueError naming what is allowed when the name does not resolve.
    """
    path = BUILTIN_WORKLOADS.get(name, name)
    module_name, sep, class_name = path.partition(":")
    allowed = f"a built-in name ({', '.join(sorted(BUILTIN_WORKLOADS))}) or 'pkg.module:ClassName'"
    if not sep or not module_name or not class_name:
        raise ValueError(f"workload.name={name!r} is not {allowed}")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        if isinstance(error, ModuleNotFoundError) and f"{module_name}.".startswith(f"{error.name}."):
            raise ValueError(f"workload.name={name!r}: cannot import module {module_name!r} ({error}); "
                             f"expected {allowed}") from error
        # The module exists but fails as it runs (a bug, a missing dependency): say what it raised, and where.
        raise ValueError(f"workload.name={name!r}: importing module {module_name!r} raised "
                         f"{_described(error)}") from error
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise ValueError(f"workload.name={name!r}: module {module_name!r} has no class {class_name!r}")
    missing = [m for m in REQUIRED_METHODS if not hasattr(cls, m)]
    if missing:
        raise ValueError(f"workload.name={name!r}: {class_name} lacks {', '.join(missing)} "
                         "(see workloads/protocol.py)")
    if hasattr(cls, "eval_dataset") != hasattr(cls, "eval_step"):
        raise ValueError(f"workload.name={name!r}: {class_name} must define eval_dataset and eval_step together "
                         "(see workloads/protocol.py)")
    return cls


def check_workload(name: str, tp: int = 1, pp: int = 1, eval_every_steps: int = 0) -> None:
    """What can be checked of workload ``name`` without building it: its class resolves (``resolve_workload_class``)
    and has the methods that tensor (``tp`` > 1) and pipeline (``pp`` > 1) parallelism need, and that evaluating
    through a pipeline every ``eval_every_steps`` needs."""
    cls = resolve_workload_class(name)
    needed = {"parallelize(model, tp_mesh)": tp > 1, "pipeline_split(model, stage, num_stages)": pp > 1,
              "pipeline_loss(output, target)": pp > 1}
    missing = [method for method, wanted in needed.items() if wanted and not hasattr(cls, method.split("(")[0])]
    if missing:
        raise ValueError(f"parallel.tp={tp}, parallel.pp={pp} needs the workload to split its model: "
                         f"workload.name={name!r} ({cls.__name__}) has no {' and no '.join(missing)} "
                         "(see workloads/protocol.py)")
    if pp > 1 and eval_every_steps and not hasattr(cls, "eval_dataset"):
        raise ValueError(f"eval.every_steps={eval_every_steps} with parallel.pp={pp} needs the workload's "
                         f"eval_dataset() and eval_step(), which evaluation runs through the pipeline (no rank holds "
                         f"the whole model for evaluate()): workload.name={name!r} ({cls.__name__}) has no "
                         "eval_dataset (see workloads/protocol.py); or set eval.every_steps=0")


def load_workload(name: str, options: dict | None = None) -> Workload:
    """Construct the workload ``name`` with ``options`` as keyword arguments."""
    cls = resolve_workload_class(name)
    try:
        return cls(**(options or {}))
    except TypeError as error:
        raise ValueError(f"workload.options for {name!r} are not accepted: {error}") from error
    except ValueError:
        raise  # the workload's own check of its options names them already
    except Exception as error:
        raise ValueError(f"workload {name!r}: constructing {cls.__name__}(**{options or {}}) raised "
                         f"{_described(error)}") from error


def _described(error: Exception) -> str:
    """``Type: message (file:line)`` of where ``error`` was raised - the user's own code, usually."""
    if isinstance(error, SyntaxError):  # its message already names the file and line
        return f"{type(error).__name__}: {error}"
    frame = traceback.extract_tb(error.__traceback__)[-1]
    return f"{type(error).__name__}: {error} ({frame.filename}:{frame.lineno})"
