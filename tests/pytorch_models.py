"""Small PyTorch models for the PyTorch-backend tests, written into a repository.

Each writer makes ``<repo>/<name>/config.pbtxt`` and ``<repo>/<name>/1/model.pt``
(TorchScript, or ``model.py`` + weights for Triton's PyTorch 2 form). torch is
imported by the writers only.
"""

from __future__ import annotations

import io
import warnings
import zipfile
from pathlib import Path
from typing import Any

IO_FP32 = '{{ name: "{name}", data_type: TYPE_FP32, dims: [ {dims} ] }}'


def _io(kind: str, names: list[str], dims: str = "4") -> str:
    return f"{kind} [ " + ", ".join(IO_FP32.format(name=n, dims=dims) for n in names) + " ]\n"


def write_config(
    repo: Path,
    name: str,
    inputs: list[str],
    outputs: list[str],
    extra: str = "",
    max_batch_size: int = 8,
    header: str = 'platform: "pytorch_libtorch"',
) -> Path:
    """``<repo>/<name>/config.pbtxt`` with FP32 [4] inputs and outputs."""
    d = repo / name
    (d / "1").mkdir(parents=True, exist_ok=True)
    text = (
        f'name: "{name}"\n{header}\nmax_batch_size: {max_batch_size}\n'
        + _io("input", inputs)
        + _io("output", outputs)
        + extra
    )
    (d / "config.pbtxt").write_text(text)
    return d


def _save(module: Any, path: Path, example: tuple[Any, ...] | None = None) -> None:
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scripted = (
            torch.jit.trace(module.eval(), example)
            if example is not None
            else torch.jit.script(module.eval())
        )
        torch.jit.save(scripted, str(path))


def add_sub(
    repo: Path, name: str = "pt_add_sub", inputs: list[str] | None = None, **kw: Any
) -> Path:
    """forward(a, b) -> (a + b, a - b); TorchScript (scripted: argument names kept)."""
    import torch

    class AddSub(torch.nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return a + b, a - b

    d = write_config(
        repo, name, inputs or ["INPUT__0", "INPUT__1"], ["OUTPUT__0", "OUTPUT__1"], **kw
    )
    _save(AddSub(), d / "1" / "model.pt")
    return d


def named_args(repo: Path, name: str = "pt_named") -> Path:
    """forward(x, y) -> x * 2 + y, configured as ``y``, ``x`` (matched by argument name)
    with one output ``result`` (configuration order)."""
    import torch

    class Named(torch.nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return x * 2 + y

    d = write_config(repo, name, ["y", "x"], ["result"])
    _save(Named(), d / "1" / "model.pt")
    return d


def dict_input(repo: Path, name: str = "pt_dict") -> Path:
    """forward(inputs: Dict[str, Tensor]) -> inputs["left"] - inputs["right"]."""
    import torch

    class DictIn(torch.nn.Module):
        def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
            return inputs["left"] - inputs["right"]

    d = write_config(repo, name, ["left", "right"], ["OUTPUT__0"])
    _save(DictIn(), d / "1" / "model.pt")
    return d


def raises_on_negative(repo: Path, name: str = "pt_raises") -> Path:
    """forward(x) -> x + 1, raising when any element is negative."""
    import torch

    class Raises(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if bool((x < 0).any()):
                raise RuntimeError("negative input")
            return x + 1

    d = write_config(repo, name, ["INPUT__0"], ["OUTPUT__0"])
    _save(Raises(), d / "1" / "model.pt")
    return d


MODEL_PY = '''
import torch


class Scale(torch.nn.Module):
    """y = x @ W (W: the weights in model.pt)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4, bias=False)

    def forward(self, x):
        return self.linear(x)
'''


def python_runtime(repo: Path, name: str = "pt_runtime") -> tuple[Path, Any]:
    """Triton's PyTorch 2 form: ``runtime: "model.py"``, weights in ``model.pt``.

    Returns:
        the model folder and the weight matrix W (numpy, [4, 4]): output = x @ W.T.
    """
    import torch

    d = write_config(
        repo,
        name,
        ["INPUT__0"],
        ["OUTPUT__0"],
        header='backend: "pytorch"\nruntime: "model.py"',
    )
    (d / "1" / "model.py").write_text(MODEL_PY)
    weight = torch.arange(16, dtype=torch.float32).reshape(4, 4) / 10
    torch.save({"linear.weight": weight}, str(d / "1" / "model.pt"))
    return d, weight.numpy()


def corrupt_copy(src: Path, dst: Path, keep: int = 700) -> None:
    """A truncated copy of a TorchScript file (no zip central directory)."""
    dst.write_bytes(src.read_bytes()[:keep])


def newer_version_copy(src: Path, dst: Path, version: int = 99) -> None:
    """A copy of a TorchScript file whose format version record says ``version``: what a
    torch newer than this one writes (torch refuses files above the version it knows)."""
    out = io.BytesIO()
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            if info.filename.endswith("/version") or info.filename == "version":
                data = f"{version}\n".encode()
            zout.writestr(info, data)
    dst.write_bytes(out.getvalue())
