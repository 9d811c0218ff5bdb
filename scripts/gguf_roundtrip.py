"""A run's final model exported to GGUF (f16 and q8_0) with `scaletune export` and read back by
transformers' own GGUF loader: the relative logit difference on the run's sample prompts and
whether greedy answers to them are equal. docs/export.md records what it printed for the
quickstart's run.

Usage: python scripts/gguf_roundtrip.py RUN_DIR [--out DIR] [--max-new-tokens N]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="where the exports go (default: a temporary folder)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = args.out or Path(tempfile.mkdtemp(prefix="gguf-roundtrip-"))
    cfg = yaml.safe_load((args.run / "config.yaml").read_text())
    prompts = (cfg.get("training") or {}).get("sample_prompts") or ["Give three tips for staying healthy."]
    merged = out / "merged"
    files = {}
    for kind, extra in (("hf", ["--merge-lora"]), ("f16", ["--format", "gguf"]), ("q8_0", ["--format", "gguf"])):
        dest = merged if kind == "hf" else out / kind
        flags = extra + ([] if kind in ("hf", "f16") else ["--gguf-type", kind])
        cmd = [sys.executable, "-m", "scaletune", "export", str(args.run), "-o", str(dest), *flags]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        files[kind] = dest if kind == "hf" else next(dest.glob("*.gguf"))
    tok = AutoTokenizer.from_pretrained(merged)
    ref = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in prompts]  # fmt: skip
    batches = [tok(t, return_tensors="pt", add_special_tokens=False).input_ids for t in texts]
    kw = {"max_new_tokens": args.max_new_tokens, "do_sample": False, "pad_token_id": tok.pad_token_id or 0}
    with torch.no_grad():
        want_logits = [ref(input_ids=ids).logits for ids in batches]
        want = [ref.generate(ids, attention_mask=torch.ones_like(ids), **kw) for ids in batches]
    for kind in ("f16", "q8_0"):
        path = files[kind]
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
        with torch.no_grad():
            rel = max(
                ((w - model(input_ids=ids).logits).norm() / w.norm()).item()
                for w, ids in zip(want_logits, batches, strict=True)
            )
            same = [torch.equal(w, model.generate(ids, attention_mask=torch.ones_like(ids), **kw))
                    for w, ids in zip(want, batches, strict=True)]  # fmt: skip
        size = path.stat().st_size / 2**20
        print(
            f"{kind}: {path.name} {size:.0f} MiB; logits vs the merged safetensors model: worst relative "
            f"{rel:.2e} over {len(batches)} prompts; greedy answers ({args.max_new_tokens} tokens) equal for "
            f"{sum(same)} of {len(same)}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
