"""The example pipelines end to end: raw photos and raw text through a real pdserve.

``image_classifier`` = preprocess (python) -> efficientnet_lite0 (ONNX) ->
postprocess (python); ``text_embedding`` = tokenize (python) -> minilm (ONNX) ->
pool (python). Goldens come from ``examples/build_pipelines.py``: PyTorch's top-5 for
the photos, sentence-transformers' embeddings for the sentences.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import GOLDENS, ServerProcess


@pytest.fixture(scope="module")
def client(example_server: ServerProcess) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(
        example_server.http_url, concurrency=16, network_timeout=120
    )


@pytest.fixture(scope="module")
def images() -> dict[str, np.ndarray]:
    data = np.load(GOLDENS / "image_classifier.npz")
    return {k: data[k] for k in data.files}


@pytest.fixture(scope="module")
def texts() -> dict[str, np.ndarray]:
    data = np.load(GOLDENS / "text_embedding.npz")
    return {k: data[k] for k in data.files}


def _image_input(items: list[bytes]) -> httpclient.InferInput:
    tensor = httpclient.InferInput("input_image_bytes", [len(items), 1], "BYTES")
    tensor.set_data_from_numpy(np.array(items, dtype=object).reshape(len(items), 1))
    return tensor


def _text_input(items: list[bytes]) -> httpclient.InferInput:
    tensor = httpclient.InferInput("text", [len(items), 1], "BYTES")
    tensor.set_data_from_numpy(np.array(items, dtype=object).reshape(len(items), 1))
    return tensor


def _assert_bad_400_good_top5(bad: list, good: list, want: tuple) -> None:
    """Each bad async request failed with 400 naming ``words``; each good one gave
    the golden top-5 (the bad ones were batched beside them)."""
    for pending, words in bad:
        with pytest.raises(InferenceServerException) as info:
            pending.get_result()
        assert info.value.status() == "400", info.value.message()
        assert words in info.value.message(), info.value.message()
    for pending in good:
        r = pending.get_result()
        _assert_top5(r.as_numpy("top5_labels")[0], r.as_numpy("top5_confidences")[0], *want)


def _assert_top5(
    labels: np.ndarray, confidences: np.ndarray, want_labels: np.ndarray, want_conf: np.ndarray
) -> None:
    """Same top-5 as PyTorch; neighbours whose confidences tie within 1e-3 may swap."""
    got = [x.decode() for x in labels]
    want = [str(x) for x in want_labels]
    np.testing.assert_allclose(confidences, want_conf, atol=1e-3)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g != w:
            j = want.index(g) if g in want else -1
            assert abs(j - i) == 1 and abs(want_conf[i] - want_conf[j]) < 1e-3, (got, want)


def test_photos_get_pytorchs_top5(client: httpclient.InferenceServerClient, images: dict) -> None:
    for row, name in enumerate(images["names"]):
        raw = images[f"image_bytes_{name}"].tobytes()
        result = client.infer("image_classifier", [_image_input([raw])])
        labels = result.as_numpy("top5_labels")
        confidences = result.as_numpy("top5_confidences")
        assert labels.shape == (1, 5) and confidences.shape == (1, 5)
        assert confidences.dtype == np.float32
        _assert_top5(
            labels[0], confidences[0], images["top5_labels"][row], images["top5_confidences"][row]
        )


def test_a_batch_and_concurrent_requests_agree(
    client: httpclient.InferenceServerClient, images: dict
) -> None:
    names = list(images["names"])
    raws = [images[f"image_bytes_{n}"].tobytes() for n in names]
    batch = client.infer("image_classifier", [_image_input(raws)])
    pending = [client.async_infer("image_classifier", [_image_input([r])]) for r in raws * 4]
    singles = [p.get_result() for p in pending]
    for row in range(len(names)):
        want = (images["top5_labels"][row], images["top5_confidences"][row])
        _assert_top5(
            batch.as_numpy("top5_labels")[row], batch.as_numpy("top5_confidences")[row], *want
        )
        for copy in range(4):
            r = singles[copy * len(names) + row]
            _assert_top5(r.as_numpy("top5_labels")[0], r.as_numpy("top5_confidences")[0], *want)


def test_text_embeddings_match_sentence_transformers(
    client: httpclient.InferenceServerClient, texts: dict
) -> None:
    sentences = [s.encode("utf-8") for s in texts["sentences"]]
    result = client.infer("text_embedding", [_text_input(sentences)])
    got = result.as_numpy("embedding")
    want = texts["embeddings"]
    assert got.shape == want.shape == (len(sentences), 384)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    cosine = (got * want).sum(axis=1) / np.linalg.norm(want, axis=1)
    assert cosine.min() >= 0.999, cosine
    # one request per sentence (other padding, other batches) gives the same vectors
    pending = [client.async_infer("text_embedding", [_text_input([s])]) for s in sentences]
    for i, p in enumerate(pending):
        np.testing.assert_allclose(p.get_result().as_numpy("embedding")[0], got[i], atol=1e-5)
    sim = got @ got.T
    for a, b in ((0, 1), (2, 3)):  # paraphrase pairs beat unrelated sentences
        for unrelated in (4, 5):
            assert sim[a, b] > sim[a, unrelated] + 0.2
            assert sim[a, b] > sim[b, unrelated] + 0.2


def _big_jpeg(width: int = 8660, height: int = 5780) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), (120, 30, 200)).save(buf, "JPEG", quality=30)
    return buf.getvalue()


def test_bad_inputs_get_clear_400s_while_good_requests_succeed(
    client: httpclient.InferenceServerClient, images: dict, texts: dict
) -> None:
    good_raw = images["image_bytes_coffee"].tobytes()
    china = images["image_bytes_china"].tobytes()
    row = list(images["names"]).index("coffee")
    want = (images["top5_labels"][row], images["top5_confidences"][row])
    bad_cases = [
        (
            "image_classifier",
            _image_input([b"this is not an image"]),
            "is not an image Pillow can decode",
        ),
        ("image_classifier", _image_input([b""]), "input_image_bytes[0] is empty"),
        (
            "image_classifier",
            _image_input([_big_jpeg()]),
            "over this model's limit of 40.0 megapixels",
        ),
        ("image_classifier", _image_input([china[: len(china) // 2]]), "could not be decoded"),
        (
            "image_classifier",
            _image_input([good_raw, b"\x89PNG\r\n\x1a\n broken"]),
            "input_image_bytes[1]",
        ),
        (
            "text_embedding",
            _text_input([b"fine", b"caf\xe9 au lait"]),
            "text[1] is not valid UTF-8",
        ),
    ]
    good = [client.async_infer("image_classifier", [_image_input([good_raw])]) for _ in range(8)]
    good_text = client.async_infer("text_embedding", [_text_input([b"a good sentence"])])
    bad = [(client.async_infer(model, [tensor]), words) for model, tensor, words in bad_cases]
    good += [client.async_infer("image_classifier", [_image_input([good_raw])]) for _ in range(8)]
    _assert_bad_400_good_top5(bad, good, want)
    assert good_text.get_result().as_numpy("embedding").shape == (1, 384)


def test_an_empty_batch_is_refused(client: httpclient.InferenceServerClient) -> None:
    tensor = httpclient.InferInput("input_image_bytes", [0, 1], "BYTES")
    tensor.set_data_from_numpy(np.empty((0, 1), dtype=object))
    with pytest.raises(InferenceServerException) as info:
        client.infer("image_classifier", [tensor])
    assert info.value.status() == "400"


def _png(width: int, height: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (width, height)).save(buf, "PNG")
    return buf.getvalue()


def _png_header(width: int, height: int) -> bytes:
    """A ~100-byte PNG whose header declares ``width x height`` pixels."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 10))
        + chunk(b"IEND", b"")
    )


def test_hostile_images_fail_only_their_own_request(
    client: httpclient.InferenceServerClient, images: dict
) -> None:
    """Decompression bombs (90-179 megapixels declared in ~100 bytes: Pillow's warning
    used to escape execute() and fail the whole batch with 500) and extreme aspect
    ratios (3000x1: 760 MB once the shorter side is resized to 256) are 400s for their
    request, refused from the header; the good requests batched with them succeed."""
    good_raw = images["image_bytes_coffee"].tobytes()
    row = list(images["names"]).index("coffee")
    want = (images["top5_labels"][row], images["top5_confidences"][row])
    bad_cases = [
        (_png_header(10000, 9000), "over this model's limit of 40.0 megapixels"),
        (_png_header(13000, 13000), "over this model's limit of 40.0 megapixels"),
        (_png(3000, 1), "aspect ratio 3000.0:1 is over this model's limit of 16:1"),
        (_png(1, 4000), "parameter max_aspect_ratio"),
        (_png_header(5000, 10), "aspect ratio"),
    ]
    for _ in range(2):
        good = [
            client.async_infer("image_classifier", [_image_input([good_raw])]) for _ in range(6)
        ]
        bad = [(client.async_infer("preprocess", [_image_input([b])]), w) for b, w in bad_cases]
        bad += [
            (client.async_infer("image_classifier", [_image_input([good_raw, b])]), w)
            for b, w in bad_cases
        ]
        good += [
            client.async_infer("image_classifier", [_image_input([good_raw])]) for _ in range(6)
        ]
        _assert_bad_400_good_top5(bad, good, want)
    # a 16:1 image is still accepted
    ok = client.infer("preprocess", [_image_input([_png(16 * 20, 20)])])
    assert ok.as_numpy("image_tensor").shape == (1, 3, 224, 224)


def test_long_texts_are_truncated_like_sentence_transformers(
    client: httpclient.InferenceServerClient,
) -> None:
    """all-MiniLM-L6-v2's max_seq_length is 256 word pieces: longer texts are cut there
    (minilm itself would fail past 512 positions), so texts that differ only after
    the first 256 word pieces have the same embedding."""
    head = " ".join(f"word{i}" for i in range(400))
    a = (head + " and then something about cats " * 50).encode()
    b = (head + " while this one talks about the stock market " * 80).encode()
    result = client.infer("text_embedding", [_text_input([a, b, b"short text"])])
    got = result.as_numpy("embedding")
    assert got.shape == (3, 384)
    np.testing.assert_allclose(got[0], got[1], atol=1e-5)
    assert float(got[0] @ got[2]) < 0.99


def test_pool_refuses_mismatched_lengths(client: httpclient.InferenceServerClient) -> None:
    tokens = httpclient.InferInput("token_embeddings", [1, 4, 384], "FP32")
    tokens.set_data_from_numpy(np.full((1, 4, 384), 0.1, np.float32))
    mask = httpclient.InferInput("attention_mask", [1, 7], "INT64")
    mask.set_data_from_numpy(np.ones((1, 7), np.int64))
    with pytest.raises(InferenceServerException) as info:
        client.infer("pool", [tokens, mask])
    assert info.value.status() == "400", info.value.message()
    assert "attention_mask" in info.value.message()


def test_non_utf8_string_to_an_onnx_model_is_400(client: httpclient.InferenceServerClient) -> None:
    meta = client.get_model_metadata("tiny_dtypes")
    inputs = []
    for spec in meta["inputs"]:
        shape = [1 if d == -1 else d for d in spec["shape"]]
        t = httpclient.InferInput(spec["name"], shape, spec["datatype"])
        if spec["datatype"] == "BYTES":
            t.set_data_from_numpy(np.full(shape, b"\xff", dtype=object))
        else:
            dtype = {"BOOL": np.bool_}.get(spec["datatype"])
            if dtype is None:
                from tritonclient.utils import triton_to_np_dtype

                dtype = triton_to_np_dtype(spec["datatype"])
            t.set_data_from_numpy(np.zeros(shape, dtype=dtype))
        inputs.append(t)
    assert any(i.datatype() == "BYTES" for i in inputs)
    with pytest.raises(InferenceServerException) as info:
        client.infer("tiny_dtypes", inputs)
    assert info.value.status() == "400", info.value.message()
    assert "not valid UTF-8" in info.value.message()
    assert "IN_STRING" in info.value.message()
