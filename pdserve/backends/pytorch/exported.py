"""PyTorch 2 exported models (``platform: "torch_aoti"``, ``<version>/model.pt2``).

Triton's pytorch backend serves ``platform: "torch_aoti"`` from ``model.pt2`` (or
``default_model_filename``). Two kinds of ``.pt2`` archive are served here, told apart
by their content: an **AOTInductor package** (``torch._inductor.aoti_compile_and_package``;
loaded with ``torch._inductor.aoti_load_package``, compiled code, what Triton runs) and
an **ExportedProgram** (``torch.export.save``; loaded with ``torch.export.load`` and run
through ``ExportedProgram.module()``). Tensor names, as Triton's: inputs ``ARGS[<i>]``
(positional argument ``i``), ``INPUT__<i>``, or ``forward``'s argument names; outputs
``RESULT`` (a single tensor), ``RESULT[<i>]`` or ``OUTPUT__<i>`` (result element ``i``).
As in Triton, nothing is auto-completed: the configuration lists every tensor.
"""

from __future__ import annotations

import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.backends.pytorch.naming import InputPlan, plan_inputs, plan_outputs
from pdserve.backends.pytorch.options import import_torch

_ARGS = re.compile(r"^ARGS\[(\d+)\]$")
_RESULT = re.compile(r"^RESULT(?:\[(\d+)\])?$")


def is_aoti_package(path: Path) -> bool:
    """Whether the ``.pt2`` archive holds AOTInductor compiled code (else it is an
    ExportedProgram). A file that is not a zip archive is neither (False)."""
    try:
        with zipfile.ZipFile(path) as z:
            return any("/data/aotinductor/" in n for n in z.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


def pt2_input_plan(names: list[str], arguments: list[str] | None) -> InputPlan:
    """Which configured input is which positional argument.

    Raises:
        ValueError: ``ARGS[<i>]`` indices not ``0 .. n-1`` once each, or a count
            that differs from the program's arguments.
    """
    found = [_ARGS.match(n) for n in names]
    if names and all(found):
        positions = [int(m.group(1)) for m in found if m]
        if sorted(positions) != list(range(len(names))):
            raise ValueError(
                f"input names {', '.join(names)} follow ARGS[<index>] but their indices "
                f"{sorted(positions)} are not 0..{len(names) - 1}, each once"
            )
        if arguments is not None and len(arguments) != len(names):
            raise ValueError(
                f"the program takes {len(arguments)} input(s) ({', '.join(arguments)}); "
                f"the configuration lists {len(names)}"
            )
        order = tuple(n for _, n in sorted(zip(positions, names, strict=True)))
        return InputPlan(False, order, "ARGS[<index>]")
    return plan_inputs(names, arguments)


def pt2_output_plan(names: list[str]) -> dict[str, int]:
    """Which result element each configured output is (``RESULT`` is element 0).

    Raises:
        ValueError: two outputs naming the same element.
    """
    found = [_RESULT.match(n) for n in names]
    if names and all(found):
        seen: dict[int, str] = {}
        for n, m in zip(names, found, strict=True):
            assert m is not None
            i = int(m.group(1)) if m.group(1) is not None else 0
            if i in seen:
                raise ValueError(f"outputs '{seen[i]}' and '{n}' both name result element {i}")
            seen[i] = n
        return {n: i for i, n in seen.items()}
    return plan_outputs(names)[0]


@dataclass
class Exported:
    """A loaded ``.pt2``: the callable, its argument names (None: unknown), its kind."""

    module: Any
    arguments: list[str] | None
    aoti: bool
    #: the ``torch.export.ExportedProgram`` (None for an AOTInductor package)
    program: Any = None


def _first_line(error: BaseException) -> str:
    lines = [ln.strip() for ln in str(error).strip().splitlines() if ln.strip()]
    return lines[0] if lines else type(error).__name__


def load_pt2(model: str, path: Path, device: Any) -> Exported:
    """Load ``path`` onto ``device`` (a ``torch.device``).

    Raises:
        RuntimeError: torch cannot load it; the message names the model, the file,
            the loader and torch's own error.
    """
    torch = import_torch()
    aoti = is_aoti_package(path)
    try:
        if aoti:
            index = device.index if device.type == "cuda" and device.index is not None else -1
            runner = torch._inductor.aoti_load_package(str(path), device_index=index)
            return Exported(runner, None, True)
        program = torch.export.load(str(path))
        if device.type != "cpu":
            from torch.export.passes import move_to_device_pass

            program = move_to_device_pass(program, device)
        arguments = [
            spec.arg.name
            for spec in program.graph_signature.input_specs
            if spec.kind.name == "USER_INPUT" and hasattr(spec.arg, "name")
        ]
        return Exported(program.module(), arguments, False, program)
    except Exception as e:
        loader = "torch._inductor.aoti_load_package" if aoti else "torch.export.load"
        raise RuntimeError(
            f"model '{model}': cannot load {path}: {loader} refused it (a .pt2 written by "
            f"torch.export.save or aoti_compile_and_package is expected; torch "
            f"{torch.__version__}): {type(e).__name__}: {_first_line(e)}"
        ) from e


def _info(name: str, value: Any) -> tuple[str, str, list[int | None]]:
    import numpy as np

    from pdserve.core import datatypes

    numpy_name = str(value.dtype).removeprefix("torch.")
    v2 = "BF16" if numpy_name == "bfloat16" else datatypes.numpy_to_v2(np.dtype(numpy_name))
    shape = [int(d) if isinstance(d, int) else None for d in value.shape]
    return name, v2, shape


def check_config_against(cfg: Any, path: Path, model: str, where: str) -> str:
    """Check the configuration's tensors against an ExportedProgram's own signature
    (datatypes, ranks, fixed dimensions, a variable batch dimension when
    ``max_batch_size > 0``); an AOTInductor package is only opened.

    Returns:
        what was checked, for the log.

    Raises:
        RuntimeError: the file cannot be loaded (:func:`load_pt2`).
        pdserve.config.ConfigError: a tensor that disagrees with the program.
    """
    from pdserve.backends.onnxruntime.autocomplete import autocomplete_from_io
    from pdserve.config import ConfigError

    torch = import_torch()
    exported = load_pt2(model, path, torch.device("cpu"))
    if exported.aoti:
        return "AOTInductor package (no signature to compare)"
    program = exported.program
    sig = program.graph_signature
    nodes = {n.name: n for n in program.graph.nodes}
    user_in = [nodes[n].meta["val"] for n in sig.user_inputs if n in nodes]
    (output_node,) = [n for n in program.graph.nodes if n.op == "output"]
    user_out = [
        a.meta["val"]
        for a in output_node.args[0]
        if hasattr(a, "name") and a.name in sig.user_outputs
    ]
    try:
        plan = pt2_input_plan([i.name for i in cfg.input], exported.arguments)
        outputs = pt2_output_plan([o.name for o in cfg.output])
    except ValueError as e:
        raise ConfigError(where, "input", str(e)) from None
    bad = [n for n, i in outputs.items() if i >= len(user_out)]
    if bad:
        raise ConfigError(
            where,
            "output",
            f"output(s) {', '.join(bad)} name result elements the program "
            f"does not have (it returns {len(user_out)} tensor(s))",
        )
    ins = [_info(n, v) for n, v in zip(plan.order, user_in, strict=False)]
    outs = [_info(n, user_out[i]) for n, i in outputs.items()]
    batching = all(s and s[0] is None for _, _, s in ins + outs)
    autocomplete_from_io(cfg, ins, outs, batching, where)
    return "ExportedProgram signature"
