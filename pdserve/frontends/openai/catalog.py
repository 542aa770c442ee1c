"""Which models the OpenAI front end serves, and as what (:func:`model_kind`), and a
generator's chat template (:func:`render_chat`). A model qualifies by its signature:

- ``embeddings``: not decoupled, one BYTES input, and as its only output a
  floating-point one (FP16, FP32, FP64) with one dimension besides the batch dimension.
- ``completions``: a BYTES input ``text_input`` and a BYTES output ``text_output``
  (Triton's generate conventions), decoupled (streaming) or not.

The config parameter ``openai`` overrides that: ``none`` hides a model; ``embeddings``
or ``completions`` declares the kind (the signature must still fit; a declared embedding
model may have other outputs beside its one vector). The parameter
``openai_dimensions: truncate`` lets ``dimensions`` shorten the vectors (Matryoshka
models): the first ``dimensions`` values, scaled back to unit length.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any

EMBEDDINGS = "embeddings"
COMPLETIONS = "completions"

_FLOATS = frozenset(("FP16", "FP32", "FP64"))

#: The tokenizer file whose ``chat_template`` (and special tokens) chat requests use.
TOKENIZER_CONFIG = "tokenizer_config.json"
#: The chat template file newer Hugging Face tokenizers save beside it.
CHAT_TEMPLATE = "chat_template.jinja"

log = logging.getLogger("pdserve.openai")


def config_parameter(config: dict[str, Any], key: str) -> str:
    """The string value of a model config parameter (Triton's JSON form), or ""."""
    value = config.get("parameters", {}).get(key)
    if isinstance(value, dict):
        return str(value.get("string_value", "")).strip().lower()
    return ""


def _item_shape(io: dict[str, Any], batching: bool) -> list[int]:
    shape = list(io.get("shape", []))
    return shape[1:] if batching else shape


def embedding_io(metadata: dict[str, Any], batching: bool) -> tuple[str, str] | None:
    """``(input name, output name)`` of an embedding model's signature, else None."""
    inputs = metadata.get("inputs", [])
    if len(inputs) != 1 or inputs[0].get("datatype") != "BYTES":
        return None
    vectors = [
        o["name"]
        for o in metadata.get("outputs", [])
        if o.get("datatype") in _FLOATS and len(_item_shape(o, batching)) == 1
    ]
    if len(vectors) != 1:
        return None
    return inputs[0]["name"], vectors[0]


def is_generator(metadata: dict[str, Any]) -> bool:
    """Whether the model follows the generate conventions (BYTES ``text_input`` in,
    BYTES ``text_output`` out)."""
    ins = {i["name"]: i.get("datatype") for i in metadata.get("inputs", [])}
    outs = {o["name"]: o.get("datatype") for o in metadata.get("outputs", [])}
    return ins.get("text_input") == "BYTES" and outs.get("text_output") == "BYTES"


def model_kind(config: dict[str, Any], metadata: dict[str, Any]) -> str | None:
    """``embeddings``, ``completions`` or None (not served) for a model's config (JSON
    form) and V2 metadata, by the module docstring's rules."""
    declared = config_parameter(config, "openai")
    if declared in ("none", "false", "off"):
        return None
    decoupled = bool(config.get("model_transaction_policy", {}).get("decoupled", False))
    batching = int(config.get("max_batch_size", 0)) > 0
    if is_generator(metadata):
        kind: str | None = COMPLETIONS
    elif not decoupled and embedding_io(metadata, batching) is not None:
        # other outputs beside the vector (an image classifier's top-5 confidences and
        # labels): only when declared
        alone = len(metadata.get("outputs", [])) == 1
        kind = EMBEDDINGS if alone or declared == EMBEDDINGS else None
    else:
        kind = None
    if declared in (EMBEDDINGS, COMPLETIONS) and declared != kind:
        return None
    return kind


def chat_template(folders: list[Path]) -> dict[str, Any] | None:
    """The chat template of the first folder in ``folders`` (version folder first) that
    ships one, as Hugging Face tokenizers save it: ``chat_template.jinja`` beside
    ``tokenizer_config.json`` (whose special tokens it uses), or the config's own
    ``chat_template``. Returned as the tokenizer config with ``chat_template`` set;
    None when no folder has one."""
    for folder in folders:
        try:
            doc = json.loads((folder / TOKENIZER_CONFIG).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            doc = {}
        if not isinstance(doc, dict):
            doc = {}
        with contextlib.suppress(OSError):
            doc["chat_template"] = (folder / CHAT_TEMPLATE).read_text(encoding="utf-8")
        if doc.get("chat_template"):
            return doc
    return None


def _special(doc: dict[str, Any], key: str) -> str:
    value = doc.get(key) or ""
    if isinstance(value, dict):  # {"content": "<s>", ...} (AddedToken)
        value = value.get("content", "")
    return str(value)


def _template_text(doc: dict[str, Any]) -> str:
    template = doc["chat_template"]
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template", "") for t in template if isinstance(t, dict)}
        return str(named.get("default") or next(iter(named.values()), ""))
    return str(template)


def default_chat(messages: list[dict[str, str]]) -> str:
    """The default chat prompt: a ``role: content`` line per message, then
    ``assistant: ``."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


def render_chat(messages: list[dict[str, str]], tokenizer: dict[str, Any] | None) -> str:
    """The prompt of a chat request: the tokenizer's ``chat_template`` rendered with
    Jinja2 in its sandbox (``messages``, ``add_generation_prompt=True``, ``bos_token``,
    ``eos_token``), as Hugging Face's ``apply_chat_template`` does; the default
    (:func:`default_chat`) when there is no template or Jinja2 is not installed.

    Raises:
        ValueError: the template fails to render (a message of the template's own
            ``raise_exception``, or a Jinja2 error).
    """
    if tokenizer is None:
        return default_chat(messages)
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        log.warning("jinja2 is not installed: the default chat template is used")
        return default_chat(messages)
    from jinja2 import TemplateError

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(_template_text(tokenizer)).render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=_special(tokenizer, "bos_token"),
            eos_token=_special(tokenizer, "eos_token"),
        )
    except TemplateError as e:
        raise ValueError(f"the model's chat template failed: {e}") from None
