"""Shared pytest fixtures: tiny random Hugging Face checkpoints built locally (no network).

Each checkpoint directory is built once per session with transformers from a config
(``torch.manual_seed(0)``), saved with ``save_pretrained(dir, safe_serialization=True)``, and
gets a small word-level ``tokenizer.json`` / ``tokenizer_config.json``.

* ``tiny_qwen2_dir``: Qwen2ForCausalLM, float32, tied embeddings, intermediate 96, head_dim 16.
* ``tiny_qwen3_dir``: Qwen3ForCausalLM, **bfloat16**, tied embeddings, q_norm/k_norm, explicit
  head_dim 32 (!= hidden/heads), intermediate 80 (down_proj in_features not a multiple of 32),
  rope_theta 1e6.
* ``tiny_qwen2_untied_dir``: Qwen2ForCausalLM, float32, separate ``lm_head.weight``,
  intermediate 80.
* ``tiny_llama_dir``: LlamaForCausalLM, float32, untied, no biases.

All: hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 128.
"""
from __future__ import annotations

import json
import os
import pathlib
import sys

import pytest


def pytest_configure(config):
    """Under pytest-xdist (``pytest -n 2 --dist loadfile``; not in addopts: the suite's Ctrl-C
    tests time out while two workers compile, and each worker compiling every kernel costs ~290 s
    more CPU than it saves on a 2-core machine) each worker process gets a numba
    cache directory of its own: ``$NUMBA_CACHE_DIR/xdist-gwN``, or ``.numba_cache/xdist-gwN`` in
    the checkout when NUMBA_CACHE_DIR is unset or empty (numba's default is ``__pycache__``
    beside the sources, one directory for both workers). numba's cache save is not safe for two
    processes saving signatures of one function at the same moment (both pick the same data file
    number; see olv_runtime.kernels.precompile), and the workers compile the same kernels while
    they run different files. Each worker and the subprocesses its tests start then use one
    cache directory as the single-process suite does. Set before numba is imported (the test
    modules import it when collected); numba's config follows if it already is."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return
    base = os.environ.get("NUMBA_CACHE_DIR") or str(config.rootpath / ".numba_cache")
    cache = os.path.join(base, f"xdist-{worker}")
    os.makedirs(cache, exist_ok=True)
    os.environ["NUMBA_CACHE_DIR"] = cache
    numba_config = sys.modules.get("numba.core.config")
    if numba_config is not None:
        numba_config.CACHE_DIR = cache


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """torch (the reference implementation of many tests) on one thread. Its default, one
    OpenMP thread per core, makes each tiny matmul wait at a barrier for a thread that numba's
    workers, a compile worker or another process holds the core of: on a loaded 2-core machine
    a 33-step greedy reference of a tiny model took 6 s instead of 0.3 s. The tests' tolerances
    and expected ids are unchanged; torch is never imported here, only configured once a test
    module (or a fixture) has imported it."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


from tiny_checkpoints import TINY, _build, _write_tokenizer  # noqa: F401


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> pathlib.Path:
    """Tiny Qwen2 checkpoint (float32, tied, q/k/v biases, intermediate 96)."""
    return _build(tmp_path_factory, "tiny_qwen2", "Qwen2ForCausalLM",
                  intermediate_size=96, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> pathlib.Path:
    """Tiny Qwen3 checkpoint (bfloat16, tied, qk-norm, head_dim 32, intermediate 80)."""
    return _build(tmp_path_factory, "tiny_qwen3", "Qwen3ForCausalLM", dtype="bfloat16",
                  intermediate_size=80, head_dim=32, tie_word_embeddings=True,
                  rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"})


@pytest.fixture(scope="session")
def tiny_qwen2_untied_dir(tmp_path_factory) -> pathlib.Path:
    """Tiny Qwen2 checkpoint with a separate lm_head (float32, intermediate 80)."""
    return _build(tmp_path_factory, "tiny_qwen2_untied", "Qwen2ForCausalLM",
                  intermediate_size=80, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> pathlib.Path:
    """Tiny Llama checkpoint (float32, untied, no biases, intermediate 96)."""
    return _build(tmp_path_factory, "tiny_llama", "LlamaForCausalLM",
                  intermediate_size=96, tie_word_embeddings=False)


#: A ChatML chat template (the Qwen2 family's turn markers) written as blocks on their own
#: lines, so the jinja2 ``trim_blocks`` / ``lstrip_blocks`` settings matter when rendering.
CHAT_TEMPLATE = """{% for message in messages %}
  {% if loop.first and message['role'] != 'system' %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
  {% endif %}
  {% if message['role'] not in ['system', 'user', 'assistant'] %}
    {{ raise_exception('unknown role ' + message['role']) }}
  {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="session")
def tiny_chat_dir(tmp_path_factory) -> pathlib.Path:
    """Tiny Qwen2 checkpoint (float32, tied, hidden 64, 2 layers) with a byte-level BPE
    tokenizer carrying ``<|im_start|>`` / ``<|im_end|>``, a ChatML ``chat_template`` in its
    tokenizer_config.json and two eos ids in generation_config.json."""
    import torch
    import transformers

    from olv_runtime.models.random_checkpoint import build_tokenizer

    tok = build_tokenizer(vocab_size=300)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    vocab = tok.get_vocab_size()
    config = transformers.Qwen2Config(**{**TINY, "vocab_size": vocab}, intermediate_size=96,
                                      tie_word_embeddings=True,
                                      bos_token_id=tok.token_to_id("<|endoftext|>"),
                                      eos_token_id=tok.token_to_id("<|im_end|>"))
    torch.manual_seed(1)
    model = transformers.Qwen2ForCausalLM(config).eval()
    out = tmp_path_factory.mktemp("tiny_chat")
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "bos_token": None, "chat_template": CHAT_TEMPLATE}))
    (out / "generation_config.json").write_text(json.dumps({
        "eos_token_id": [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]}))
    return out


@pytest.fixture(scope="session")
def tiny_chat_models(tiny_chat_dir, tmp_path_factory) -> dict:
    """``tiny_chat_dir`` converted twice: {"int4": path, "float32": path} (tokenizer files
    copied beside each)."""
    from olv_runtime.models.hf import convert

    out = {}
    for w in ("int4-block32", "float32"):
        d = tmp_path_factory.mktemp(f"tiny_chat_{w}")
        convert(tiny_chat_dir, d / "model.onnx", weights=w)
        out["int4" if w.startswith("int4") else "float32"] = d / "model.onnx"
    return out


@pytest.fixture(scope="module")
def module_digest_cache(tmp_path_factory):
    """``OLV_CACHE_DIR`` set to a fresh directory for one test module (the compiled-entry
    digest cache of olv_runtime.structs.compiled; never the user's) and ``OLV_VERIFY_DIGESTS`` unset.
    Use with ``pytestmark = pytest.mark.usefixtures("module_digest_cache")``."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OLV_CACHE_DIR", str(tmp_path_factory.mktemp("olv-cache")))
        mp.delenv("OLV_VERIFY_DIGESTS", raising=False)
        yield
