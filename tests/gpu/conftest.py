"""The GPU tier: every test here needs a CUDA GPU and is skipped without one (`-m gpu` selects it).
`scripts/gpu_check.sh` runs the tier and the gpu-1b benchmark and writes one report."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)


@pytest.fixture(scope="session")
def mid_model_dir(tmp_path_factory):
    """A Llama of 0.34B parameters (hidden 1024, 12 layers, OLMo-2's 100,352-entry vocabulary and
    tokenizer bundled with scaletune, untied head) with random weights: large enough that memory and
    time are the model's, not fixed overheads."""
    from tests.helpers import REPO_ROOT, save_random_llama

    return save_random_llama(
        tmp_path_factory.mktemp("models") / "llama-0.3b",
        REPO_ROOT / "src" / "scaletune" / "assets" / "olmo2-dolma2.json",
        vocab_size=100_352,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
