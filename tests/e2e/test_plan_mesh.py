"""`scaletune plan CONFIG --seq-len N` as a user runs it: Llama-3-8B (the planner-only preset, meta
device, no weights) at 131,072 tokens on 8 GPUs of 80 GB recommends a context degree, and its
per-rank bytes equal the arithmetic written out here from the published shapes (Korthikanti et al.
2022 for the activations, DeepSpeed-Ulysses for the context split, FSDP2's dim-0 chunks); the
smaller degree's total is above the device. Exit codes: 0 for a plan (whatever fits), 2 for bad
arguments; a configured mesh the model cannot take is a warning in the plan."""

from __future__ import annotations

import json

from tests.helpers import run_cli

GiB = 2**30
MEM_GIB = 79.6  # an H100 80GB HBM3 as nvidia-smi reports it: 81,559 MiB
H, I, L, HEADS, KV, HEAD_DIM, V = 4096, 14336, 32, 32, 8, 128, 128256
S = 131072

CONFIG = """\
model: {name_or_path: llama-3-8b, dtype: bfloat16}
data: {dummy: {}, max_seq_length: 2048}
training: {global_batch_size: 8, micro_batch_size: 1}
"""


def _expected(context: int, world: int = 8) -> dict[str, int]:
    """Rank 0's bytes for a full bf16 fine-tune under fsdp with the context degree (tensor 1)."""
    layer = [(H, H), (KV * HEAD_DIM, H), (KV * HEAD_DIM, H), (H, H), (I, H), (I, H), (H, I), (H,), (H,)]
    tensors = [(V, H), (V, H), (H,)] + layer * L  # embeddings, head, final norm, layers
    shard = sum(-(-t[0] // world) * (t[1] if len(t) > 1 else 1) for t in tensors)  # FSDP2 over 8 = d x c
    params, grads, optimizer = 4 * shard, 4 * shard, 8 * shard + 4 * len(tensors)
    tokens = S // context  # micro_batch_size 1
    per_layer = tokens * (2 * H * 2 + 2 * H * 2 + 2 * (2 * HEADS * HEAD_DIM + 2 * KV * HEAD_DIM + 4 * I))
    per_layer += 4 * HEADS * tokens  # fp32 logsumexp, heads / context over the whole sequence
    act = L * tokens * H * 2 + per_layer + 1024 * V * (2 + 12) + 2 * tokens * H * 2  # checkpointing
    layer_params = sum(t[0] * (t[1] if len(t) > 1 else 1) for t in layer)
    margin = layer_params * (2 * 2 + 4) + (params + grads + optimizer + act) // 10
    return {
        "params": params,
        "grads": grads,
        "optimizer": optimizer,
        "activations": act,
        "reference": 0,
        "kv_cache": 0,
    } | {"total": params + grads + optimizer + act + margin}


def test_llama3_8b_at_128k_names_a_context_degree(tmp_path):
    path = tmp_path / "llama.yaml"
    path.write_text(CONFIG)
    args = ["plan", str(path), "--seq-len", str(S), "--gpus", "8", "--gpu-memory", str(MEM_GIB)]
    proc = run_cli([*args, "--json"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads(proc.stdout)["mesh_recommendation"]
    assert rec["seq_len"] == S
    chosen = rec["chosen"]
    assert chosen["mesh"] == {"pipeline": 1, "data_shard": 4, "context": 2, "tensor": 1}
    assert chosen["per_rank_bytes"] == _expected(2)
    assert _expected(2)["total"] <= MEM_GIB * GiB < _expected(1)["total"]
    smaller = rec["candidates"][0]
    assert smaller["mesh"]["context"] == 1 and smaller["per_rank_bytes"] == _expected(1) and not smaller["fits"]

    text = run_cli(args, timeout=300)
    assert text.returncode == 0, text.stderr[-3000:]
    out = text.stdout
    assert "recommended mesh: fsdp dp4 cp2 tp1" in out and "context_parallel 2" in out
    assert f"{_expected(2)['total'] / GiB:.2f} GiB <= {MEM_GIB:.2f} GiB" in out  # the per-rank total
    assert f"fsdp dp8 cp1 tp1: needs {_expected(1)['total'] / GiB:.2f} GiB" in out
    assert "max_position_embeddings (8,192)" in out  # Llama-3-8B was built for 8,192 positions


def test_exit_codes_and_a_mesh_the_model_cannot_take(tmp_path):
    path = tmp_path / "llama.yaml"
    path.write_text(CONFIG)
    bad = run_cli(["plan", str(path), "--seq-len", "0", "--gpus", "8", "--gpu-memory", "80"], timeout=120)
    assert bad.returncode == 2 and "--seq-len must be 1 or more" in bad.stderr + bad.stdout
    assert "Traceback" not in bad.stderr
    short = run_cli(["plan", str(path), "--seq-len", "4", "--gpus", "8", "--gpu-memory", "80"], timeout=120)
    assert short.returncode == 2 and "max_seq_length" in short.stderr + short.stdout
    odd = tmp_path / "odd.yaml"
    odd.write_text(CONFIG + "distributed: {tensor_parallel: 3}\n")
    proc = run_cli(["plan", str(odd), "--gpus", "6", "--gpu-memory", "80"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "configured mesh fsdp dp2 cp1 tp3" in proc.stdout
    assert "warning: distributed.tensor_parallel 3 does not divide the model's attention heads (32)" in proc.stdout


def test_a_configured_strategy_is_marked_as_configured(tmp_path):
    """`strategy: single` is the run's, whatever the planner would take for `auto` (issue 40: plan
    marked ddp "chosen" for such a config): the configured row is starred and named as configured."""
    single = tmp_path / "single.yaml"
    single.write_text(CONFIG + "distributed: {strategy: single}\n")
    proc = run_cli(["plan", str(single)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "configured: single (row ddp, one whole replica); distributed.strategy auto would choose " in proc.stdout
    assert "chosen:" not in proc.stdout and "│ ddp *" in proc.stdout, proc.stdout
