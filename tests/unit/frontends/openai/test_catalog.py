"""Which models the OpenAI front end serves, and chat templates
(pdserve.frontends.openai.catalog)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.frontends.openai import catalog

EMBEDDER = {
    "inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1, 1]}],
    "outputs": [{"name": "embedding", "datatype": "FP32", "shape": [-1, 384]}],
}
GENERATOR = {
    "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1]}],
    "outputs": [{"name": "text_output", "datatype": "BYTES", "shape": [1]}],
}


def _config(batch: int = 8, decoupled: bool = False, openai: str = "") -> dict:
    config: dict = {"max_batch_size": batch, "model_transaction_policy": {"decoupled": decoupled}}
    if openai:
        config["parameters"] = {"openai": {"string_value": openai}}
    return config


def test_kinds_by_signature() -> None:
    assert catalog.model_kind(_config(), EMBEDDER) == "embeddings"
    assert catalog.embedding_io(EMBEDDER, True) == ("text", "embedding")
    assert catalog.model_kind(_config(0, True), GENERATOR) == "completions"
    assert catalog.model_kind(_config(decoupled=True), EMBEDDER) is None
    image = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 3]}],
        "outputs": EMBEDDER["outputs"],
    }
    assert catalog.model_kind(_config(), image) is None


def test_a_vector_beside_other_outputs_needs_the_declaration() -> None:
    classifier = {
        "inputs": [{"name": "image", "datatype": "BYTES", "shape": [-1, 1]}],
        "outputs": [
            {"name": "labels", "datatype": "BYTES", "shape": [-1, 5]},
            {"name": "confidences", "datatype": "FP32", "shape": [-1, 5]},
        ],
    }
    assert catalog.model_kind(_config(), classifier) is None
    assert catalog.model_kind(_config(openai="embeddings"), classifier) == "embeddings"


def test_the_openai_parameter_hides_or_declares() -> None:
    assert catalog.model_kind(_config(openai="none"), EMBEDDER) is None
    assert catalog.model_kind(_config(openai="embeddings"), EMBEDDER) == "embeddings"
    assert catalog.model_kind(_config(openai="completions"), EMBEDDER) is None


def test_default_chat_prompt() -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert catalog.render_chat(messages, None) == "system: be brief\nuser: hi\nassistant: "


def test_tokenizer_chat_template(tmp_path: Path) -> None:
    pytest.importorskip("jinja2")
    template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": template, "bos_token": {"content": "<s>"}})
    )
    tokenizer = catalog.chat_template([tmp_path / "missing", tmp_path])
    assert tokenizer is not None
    text = catalog.render_chat([{"role": "user", "content": "hi"}], tokenizer)
    assert text == "<s><|user|>hi<|assistant|>"
    broken = {"chat_template": "{{ raise_exception('roles must alternate') }}"}
    with pytest.raises(ValueError, match="roles must alternate"):
        catalog.render_chat([], broken)


def test_chat_template_jinja_file_beside_the_tokenizer_config(tmp_path: Path) -> None:
    """Newer Hugging Face tokenizers save the template as chat_template.jinja; the
    special tokens stay in tokenizer_config.json. The version folder comes first."""
    pytest.importorskip("jinja2")
    model, version = tmp_path, tmp_path / "1"
    version.mkdir()
    (version / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>"}))
    (version / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    )
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": "unused"}))
    tokenizer = catalog.chat_template([version, model])
    assert tokenizer is not None
    assert catalog.render_chat([{"role": "user", "content": "hi"}], tokenizer) == "hi<|end|>"
    (version / "chat_template.jinja").unlink()
    assert catalog.chat_template([version, model]) == {"chat_template": "unused"}
    assert catalog.chat_template([tmp_path / "missing"]) is None
