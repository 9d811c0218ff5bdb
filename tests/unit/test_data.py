"""scaletune.data: formats, label masks, truncation, packing (with a loss-level proof that packs do
not leak attention), the collator, every bad input, the eval split, dummy data and the cache.

Token-level expectations use the real tokenizers and Alpaca records of ../shared/data.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from scaletune import data as D
from scaletune.config import DataConfig, DataSource
from scaletune.errors import ConfigError, DataError

IGN = -100
IM_START, IM_END = 100264, 100265  # olmo2-dolma2 special tokens


@pytest.fixture(scope="module")
def alpaca_path(shared_data) -> Path:
    return shared_data / "alpaca_5000.json"


@pytest.fixture(scope="module")
def neox(shared_data):
    from transformers import PreTrainedTokenizerFast

    path = shared_data / "tokenizers" / "gpt-neox-20b.json"
    return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|endoftext|>", pad_token="<|padding|>")


@pytest.fixture(scope="module")
def olmo(shared_data):
    from transformers import PreTrainedTokenizerFast

    path = shared_data / "tokenizers" / "olmo2-dolma2.json"
    return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|endoftext|>", pad_token="<|pad|>")


@pytest.fixture(scope="module")
def alpaca(alpaca_path) -> list[dict]:
    return json.loads(alpaca_path.read_text())


def write_json(path: Path, records) -> str:
    path.write_text(json.dumps(records))
    return str(path)


def write_jsonl(path: Path, lines: list) -> str:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return str(path)


def build(tmp_path, tokenizer, seed=0, max_positions=None, **data):
    return D.build_datasets(
        DataConfig(**data), tokenizer, seed=seed, max_positions=max_positions, cache_dir=tmp_path / "cache"
    )


def trained_runs(labels: list[int]) -> list[list[int]]:
    """Maximal runs of trained labels."""
    runs, cur = [], []
    for x in labels + [IGN]:
        if x != IGN:
            cur.append(x)
        elif cur:
            runs.append(cur)
            cur = []
    return runs


# ---------------------------------------------------------------------------------------------
# Formats and masks


def test_alpaca_masks_prompt_and_trains_output_plus_eos(tmp_path, neox, alpaca):
    with_input, without_input = alpaca[0], alpaca[4]
    assert with_input["input"] and not without_input["input"]
    path = write_json(tmp_path / "a.json", [with_input, without_input])
    b = build(tmp_path, neox, train={"path": path}, max_seq_length=512)
    assert b.stats["train_rows"] == 2 and b.stats["truncated"] == 0 and b.stats["dropped_empty"] == 0
    eos = neox.eos_token_id
    for row, rec in zip(b.train, (with_input, without_input)):
        template = D.ALPACA_PROMPT if rec["input"] else D.ALPACA_PROMPT_NO_INPUT
        prompt = neox(template.format(**rec))["input_ids"]
        target = neox(rec["output"], add_special_tokens=False)["input_ids"] + [eos]
        assert row["input_ids"] == prompt + target
        assert row["labels"] == [IGN] * len(prompt) + target
        assert row["position_ids"] == list(range(len(prompt) + len(target)))
        trained = [t for t in row["labels"] if t != IGN]
        assert neox.decode(trained[:-1]) == rec["output"] and trained[-1] == eos
        prompt_text = neox.decode(row["input_ids"][: len(prompt)])
        assert prompt_text.endswith("### Response:\n")
        assert ("### Input:\n" + rec["input"] in prompt_text) == bool(rec["input"])
    # Exact ids: alpaca[0] answers "No" (neox id 2302), then <|endoftext|> (0).
    assert b.train[0]["labels"][-2:] == [2302, 0] and b.train[0]["labels"][-3] == IGN
    assert b.train[1]["labels"][-59:-56] == [IGN, 4041, 2900]  # "One solution ..."


CONV = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "content": "Seven."},
    {"role": "user", "content": "Another?"},
    {"role": "assistant", "content": "Eleven, and 13."},
]


def test_messages_chatml_trains_only_assistant_turns(tmp_path, olmo):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONV}])
    b = build(tmp_path, olmo, train={"path": path, "format": "messages"}, max_seq_length=256)
    row = b.train[0]
    rendered = (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nName a prime.<|im_end|>\n"
        "<|im_start|>assistant\nSeven.<|im_end|>\n<|im_start|>user\nAnother?<|im_end|>\n"
        "<|im_start|>assistant\nEleven, and 13.<|im_end|>\n"
    )
    assert row["input_ids"] == olmo(rendered, add_special_tokens=False)["input_ids"]
    assert row["input_ids"].count(IM_START) == 5 and row["input_ids"].count(IM_END) == 5
    enc = lambda s: olmo(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert trained_runs(row["labels"]) == [enc("Seven.") + [IM_END], enc("Eleven, and 13.") + [IM_END]]
    # Exact mask: everything before "Seven." (system, user, "<|im_start|>assistant\n") is masked,
    # and so is the newline after each <|im_end|>.
    head = enc(rendered[: rendered.index("Seven.")])
    assert row["input_ids"][: len(head)] == head and row["labels"][: len(head)] == [IGN] * len(head)
    n1 = len(head) + len(enc("Seven.")) + 1
    assert row["labels"][len(head) : n1] == row["input_ids"][len(head) : n1]
    assert row["labels"][n1] == IGN and olmo.decode([row["input_ids"][n1]]) == "\n"
    assert row["labels"][-1] == IGN and row["labels"][-2] == IM_END
    # The whole row, id by id: [im_start] system \n You are terse . [im_end] \n [im_start] user \n Name a
    # prime . [im_end] \n [im_start] assistant \n | Seven . [im_end] | \n [im_start] user \n Another ?
    # [im_end] \n [im_start] assistant \n | Ele ven , and _ 13 . [im_end] | \n
    M = IGN
    assert row["input_ids"] == [
        100264,
        9125,
        198,
        2675,
        527,
        51637,
        13,
        100265,
        198,
        100264,
        882,
        198,
        678,
        264,
        10461,
        13,
        100265,
        198,
        100264,
        78191,
        198,
        60628,
        13,
        100265,
        198,
        100264,
        882,
        198,
        14364,
        30,
        100265,
        198,
        100264,
        78191,
        198,
        46439,
        1055,
        11,
        323,
        220,
        1032,
        13,
        100265,
        198,
    ]
    assert row["labels"] == [
        M,
        M,
        M,
        M,
        M,
        M,
        M,
        M,
        M,
        M,
        M,
        M,
        M,
        M,
        M,
        M,
        M,
        M,
        M,
        M,
        M,
        60628,
        13,
        100265,
        M,
        M,
        M,
        M,
        M,
        M,
        M,
        M,
        M,
        M,
        M,
        46439,
        1055,
        11,
        323,
        220,
        1032,
        13,
        100265,
        M,
    ]
    assert b.stats["train_target_tokens"] == sum(len(r) for r in trained_runs(row["labels"]))


ZEPHYR = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def test_messages_template_precedence_config_then_tokenizer(tmp_path, neox):
    import copy

    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONV}])
    tok = copy.deepcopy(neox)
    tok.chat_template = ZEPHYR
    src = {"path": path, "format": "messages"}
    b = build(tmp_path, tok, train=src, max_seq_length=256)  # the tokenizer's template
    runs = [neox.decode(r) for r in trained_runs(b.train[0]["labels"])]
    assert runs == ["Seven.<|endoftext|>", "Eleven, and 13.<|endoftext|>"]
    assert neox.decode(b.train[0]["input_ids"]).startswith("<|system|>\nYou are terse.<|endoftext|>\n<|user|>")
    # data.chat_template wins over the tokenizer's: here the built-in ChatML, spelled out.
    b = build(tmp_path, tok, train=src, max_seq_length=256, chat_template=D.CHATML_TEMPLATE)
    runs = [neox.decode(r) for r in trained_runs(b.train[0]["labels"])]
    assert runs == ["Seven.<|im_end|>", "Eleven, and 13.<|im_end|>"]
    assert D.resolve_chat_template(DataConfig(train=src), neox) == D.CHATML_TEMPLATE


def test_the_template_a_run_trained_with_is_the_last_chat_stages(neox):
    """What final/ and `scaletune export` write into the tokenizer (trained_chat_template): the
    resolved template of the last stage whose train or eval data went through it, else none."""
    alpaca = DataConfig(train={"path": "a.json"})
    chat = DataConfig(train={"path": "c.jsonl", "format": "messages"}, chat_template=ZEPHYR)
    chat_eval = DataConfig(train={"path": "a.json"}, eval={"path": "e.json", "template": "chat"})
    assert D.trained_chat_template([alpaca], neox) is None  # never rendered as chat: no claim
    assert D.trained_chat_template([alpaca, chat], neox) == ZEPHYR
    assert D.trained_chat_template([chat, alpaca], neox) == ZEPHYR  # a later non-chat stage keeps it
    assert D.trained_chat_template([chat, chat_eval], neox) == D.CHATML_TEMPLATE  # the last chat stage's
    assert D.trained_chat_template([DataConfig(dummy={})], neox) is None


def test_messages_template_that_is_not_prefix_stable_is_refused(tmp_path, olmo):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONV}])
    counting = "{{ messages|length }}" + D.CHATML_TEMPLATE
    with pytest.raises(DataError, match="prefix"):
        build(tmp_path, olmo, train={"path": path, "format": "messages"}, chat_template=counting)


def test_text_format_trains_everything_and_appends_eos(tmp_path, neox, alpaca):
    texts = [alpaca[4]["output"], alpaca[5]["output"]]
    path = write_jsonl(tmp_path / "t.jsonl", [{"body": t} for t in texts])
    b = build(tmp_path, neox, train={"path": path, "format": "text", "field": "body"}, max_seq_length=512)
    for row, text in zip(b.train, texts):
        ids = neox(text)["input_ids"] + [neox.eos_token_id]
        assert row["input_ids"] == ids
        assert row["labels"] == [IGN] + ids[1:]  # nothing predicts the first token
    assert b.train[0]["input_ids"][:2] == [4041, 2900]
    assert b.stats["train_target_tokens"] == sum(len(r["input_ids"]) - 1 for r in b.train)


# ---------------------------------------------------------------------------------------------
# Truncation


def test_truncation_right_side_and_dropped_count(tmp_path, neox, alpaca):
    short = {"instruction": "Say hi.", "input": "", "output": "Hi!"}
    long_answer = alpaca[4]  # 57 response tokens: cut, keeps some
    long_prompt = {"instruction": " ".join(["word"] * 80), "input": "", "output": "ok"}  # prompt alone > 64
    path = write_json(tmp_path / "a.json", [short, long_answer, long_prompt])
    b = build(tmp_path, neox, train={"path": path}, max_seq_length=64)
    assert b.stats["train_records"] == 3 and b.stats["train_rows"] == 2
    assert b.stats["dropped_empty"] == 1 and b.stats["truncated"] == 1
    cut = b.train[1]
    full_prompt = neox(D.ALPACA_PROMPT_NO_INPUT.format(**long_answer))["input_ids"]
    target = neox(long_answer["output"], add_special_tokens=False)["input_ids"]
    assert cut["input_ids"] == (full_prompt + target)[:64]
    assert cut["labels"][len(full_prompt) :] == target[: 64 - len(full_prompt)]
    assert b.train[0]["labels"][-1] == neox.eos_token_id


def test_everything_truncated_away_is_an_error(tmp_path, neox, alpaca):
    path = write_json(tmp_path / "a.json", alpaca[:5])
    with pytest.raises(DataError, match=r"all 5 records were dropped.*raise data.max_seq_length"):
        build(tmp_path, neox, train={"path": path}, max_seq_length=8)


def test_max_seq_length_above_model_limit(tmp_path, neox, alpaca_path):
    with pytest.raises(DataError, match=r"data.max_seq_length \(4096\).*max_position_embeddings \(2048\)"):
        build(tmp_path, neox, train={"path": str(alpaca_path)}, max_seq_length=4096, max_positions=2048)


# ---------------------------------------------------------------------------------------------
# Packing


def test_packing_layout(tmp_path, neox, alpaca):
    path = write_json(tmp_path / "a.json", alpaca[:40])
    common = dict(train={"path": path}, max_seq_length=256)
    flat = build(tmp_path, neox, **common).train
    packed = build(tmp_path, neox, packing=True, **common).train
    examples = list(flat)
    assert len(packed) < len(examples)
    it = iter(examples)
    ex = next(it, None)
    for row in packed:
        n = 0
        while ex is not None and n + len(ex["input_ids"]) <= 256:
            L = len(ex["input_ids"])
            assert row["input_ids"][n : n + L] == ex["input_ids"]
            assert row["labels"][n : n + L] == ex["labels"]
            assert row["labels"][n] == IGN  # boundary: the first token of every example
            assert row["position_ids"][n : n + L] == list(range(L))
            n += L
            ex = next(it, None)
        assert n == len(row["input_ids"]) <= 256
        assert ex is None or n + len(ex["input_ids"]) > 256  # greedy: the next one did not fit
    assert ex is None
    s = build(tmp_path, neox, packing=True, **common).stats
    assert s["train_target_tokens"] == sum(sum(x != IGN for x in r["labels"]) for r in examples)


def tiny_olmo2(vocab: int, attn: str):
    from transformers import AutoModelForCausalLM, Olmo2Config

    torch.manual_seed(0)
    cfg = Olmo2Config(
        vocab_size=(vocab + 63) // 64 * 64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        initializer_range=0.2,  # large enough that attending to another example visibly changes the loss
    )
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32).eval()


def summed_loss(model, batch: dict, use_cache: bool = False) -> float:
    """Sum of the token losses (summed in float64) after the causal shift. The vocabulary projection runs only
    at the predicting positions: the full [B, T, 100k] logits would dominate the test's time."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    targets = batch["labels"][:, 1:]
    keep = targets != IGN
    with torch.no_grad():
        hidden = model.model(**inputs, use_cache=use_cache).last_hidden_state[:, :-1][keep]
        losses = torch.nn.functional.cross_entropy(model.lm_head(hidden), targets[keep], reduction="none")
    return float(losses.double().sum())


def differs(a: float, b: float) -> bool:
    return abs(a - b) > 1e-4 * abs(b)  # ten times the tolerance of the equality


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_loss_equals_unpacked_loss(tmp_path, olmo, alpaca, attn):
    path = write_json(tmp_path / "a.json", alpaca[:8])
    common = dict(train={"path": path}, max_seq_length=160)
    flat = build(tmp_path, olmo, **common).train
    packed = build(tmp_path, olmo, packing=True, **common).train
    assert len(packed) < len(flat)
    collate = D.Collator(olmo.pad_token_id)
    flat_batch, packed_batch = collate(list(flat)), collate(list(packed))
    assert "attention_mask" in flat_batch and "attention_mask" not in packed_batch
    assert D.count_target_tokens(flat_batch["labels"]) == D.count_target_tokens(packed_batch["labels"])
    real_tokens = sum(len(r["input_ids"]) for r in flat)
    assert D.count_input_tokens(flat_batch) == D.count_input_tokens(packed_batch) == real_tokens

    model = tiny_olmo2(len(olmo), attn)
    reference = summed_loss(model, flat_batch)
    assert summed_loss(model, packed_batch) == pytest.approx(reference, rel=1e-5)
    # The same rows without position resets, or with a 2D attention mask, attend across examples:
    # the loss changes, so the equality above is a real check.
    ids = packed_batch["input_ids"]
    leaky = dict(packed_batch, position_ids=torch.arange(ids.shape[1]).expand_as(ids))
    assert differs(summed_loss(model, leaky), reference)
    with_mask = dict(packed_batch, attention_mask=torch.ones_like(packed_batch["input_ids"]))
    assert differs(summed_loss(model, with_mask), reference)
    # transformers looks for packed rows only without a KV cache: the trainer must pass use_cache=False.
    assert differs(summed_loss(model, packed_batch, use_cache=True), reference)


def test_packing_support_by_attention_implementation():
    for ok in ("sdpa", "eager", "flex_attention", None):
        D.check_packing_support(ok, micro_batch_size=8)
    D.check_packing_support("flash_attention_2", micro_batch_size=1)
    with pytest.raises(ConfigError, match="micro_batch_size 1"):
        D.check_packing_support("flash_attention_2", micro_batch_size=4)
    with pytest.raises(ConfigError, match="model.attn_implementation my_kernel"):
        D.check_packing_support("my_kernel", micro_batch_size=1)


# ---------------------------------------------------------------------------------------------
# Collator and counting


def test_collator_pads_and_masks():
    rows = [
        {"input_ids": [5, 6, 7], "labels": [IGN, 6, 7], "position_ids": [0, 1, 2]},
        {"input_ids": [8, 9], "labels": [IGN, 9], "position_ids": [0, 1]},
    ]
    b = D.Collator(pad_token_id=1)(rows)
    assert set(b) == {"input_ids", "labels", "position_ids", "attention_mask"}
    assert all(v.dtype == torch.long and v.shape == (2, 3) for v in b.values())
    assert b["input_ids"].tolist() == [[5, 6, 7], [8, 9, 1]]
    assert b["labels"].tolist() == [[IGN, 6, 7], [IGN, 9, IGN]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert D.count_target_tokens(b["labels"]) == 3 and D.count_input_tokens(b) == 5

    b = D.Collator(pad_token_id=1, pad_to_multiple_of=4)(rows)
    assert b["input_ids"].shape == (2, 4) and b["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0]]

    packed = {"input_ids": [5, 6, 7, 8, 9], "labels": [IGN, 6, IGN, 8, 9], "position_ids": [0, 1, 0, 1, 2]}
    b = D.Collator(pad_token_id=1)([packed, rows[1]])
    assert "attention_mask" not in b
    # Padding: position 0 at every pad token, so each is its own sequence in transformers' mask.
    assert b["position_ids"].tolist() == [[0, 1, 0, 1, 2], [0, 1, 0, 0, 0]]
    assert b["labels"].tolist() == [[IGN, 6, IGN, 8, 9], [IGN, 9, IGN, IGN, IGN]]
    assert D.count_target_tokens(b["labels"]) == 4 and D.count_input_tokens(b) == 7
    from transformers.masking_utils import find_packed_sequence_indices

    assert find_packed_sequence_indices(b["position_ids"]).tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 2, 3]]


def test_count_target_tokens_is_after_the_shift():
    labels = torch.tensor([[3, IGN, 4, 5], [IGN, IGN, 6, IGN]])
    assert D.count_target_tokens(labels) == 3  # the 3 in column 0 is never predicted


# ---------------------------------------------------------------------------------------------
# Bad input


def test_missing_file_is_named(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match=f"{missing}: data file not found"):
        D.load_records(DataSource(path=str(missing)))


def test_malformed_jsonl_reports_every_problem_with_file_and_line(tmp_path):
    lines = [
        {"instruction": "a", "output": "b"},
        "{not json",
        "",
        {"instruction": "c"},
        '{"instruction": "d", "output": 3}',
        "[1, 2",
    ]
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DataError) as err:
        D.load_records(DataSource(path=path))
    problems = err.value.problems
    assert len(problems) == 4
    assert problems[0].startswith(f"{path}:2: not valid JSON")
    assert problems[1] == f"{path}:4: record 3: missing field 'output' (format alpaca)"
    assert problems[2] == f"{path}:5: record 4: field 'output' must be a string"
    assert problems[3].startswith(f"{path}:6: not valid JSON")


def test_content_of_text_parts_alone_is_their_text(tmp_path):
    """`content` as a list of text parts (the vision-language layout) without an image reads as the
    string it holds, as a text model's chat template reads content."""
    path = tmp_path / "parts.jsonl"
    turns = [
        {"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}]},
        {"role": "assistant", "content": "Blue."},
    ]
    path.write_text(json.dumps({"messages": turns}) + "\n")
    records = D.load_records(DataSource(path=str(path), format="messages"))
    assert records == [{"messages": [{"role": "user", "content": "Name a colour."}, turns[1]]}]


def test_missing_fields_in_json_name_record_and_field(tmp_path):
    recs = [{"instruction": "a", "output": "b"}, {"output": "x"}, {"messages": []}]
    path = write_json(tmp_path / "a.json", recs)
    with pytest.raises(DataError) as err:
        D.load_records(DataSource(path=path))
    assert err.value.problems == [
        f"{path}: record 2: missing field 'instruction' (format alpaca)",
        f"{path}: record 3: missing field 'instruction' (format alpaca)",
        f"{path}: record 3: missing field 'output' (format alpaca)",
    ]
    chat = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "robot", "content": "x"}]}, {"text": "y"}])
    with pytest.raises(DataError) as err:
        D.load_records(DataSource(path=chat, format="messages"))
    assert err.value.problems == [
        f"{chat}:1: record 1: messages[0] must be an object with 'role' (one of system, user, assistant) "
        "and 'content' (a string, or a list of text and image parts)",
        f"{chat}:2: record 2: missing field 'messages' (format messages)",
    ]


def test_records_of_another_format_are_one_line_naming_it(tmp_path):
    """A chat file read as alpaca: one line naming the format its records have and the key to set,
    not a "missing field" line a record (issue 39); its other problems follow. The control: records
    of no format keep a line each."""
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": turns}] * 30 + [{"messages": "x", "y": 1}])
    with pytest.raises(DataError) as err:
        D.validate_data(DataConfig(train=DataSource(path=chat, format="alpaca")))
    assert err.value.problems == [
        f"data.train: {chat}: the records have 'messages', the fields of format messages, not 'instruction' "
        "or 'output' (format alpaca): set data.train.format: messages"
    ]
    assert len(D.load_records(DataSource(path=chat, format="messages", max_samples=30))) == 30
    odd = write_jsonl(tmp_path / "odd.jsonl", [{"question": "a", "answer": "b"}] * 3)
    with pytest.raises(DataError) as err:
        D.load_records(DataSource(path=odd))
    assert len(err.value.problems) == 6 and all("missing field" in p for p in err.value.problems)


def test_problem_list_is_capped(tmp_path):
    path = write_json(tmp_path / "a.json", [{"x": i} for i in range(15)])
    with pytest.raises(DataError) as err:
        D.load_records(DataSource(path=path))
    assert len(err.value.problems) == 21 and err.value.problems[-1] == "... and 10 more"


def test_validate_data_reports_train_and_eval_together(tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", ["{oops"])
    cfg = DataConfig(train={"path": bad}, eval={"path": str(tmp_path / "gone.json")})
    with pytest.raises(DataError) as err:
        D.validate_data(cfg)
    assert [p.split(":")[0] for p in err.value.problems] == ["data.train", "data.eval"]
    assert f"{bad}:1: not valid JSON" in err.value.problems[0] and "gone.json" in err.value.problems[1]
    D.validate_data(DataConfig(train={"path": bad}, dummy={"num_samples": 4}))  # dummy replaces train


def test_sources_jsonl_max_samples_and_dataset_folder(tmp_path, alpaca):
    folder = tmp_path / "ds"
    folder.mkdir()
    write_jsonl(folder / "part.jsonl", alpaca[:30])
    recs = D.load_records(DataSource(path=str(folder / "part.jsonl"), max_samples=7))
    assert recs == alpaca[:7]
    recs = D.load_records(DataSource(path=str(folder), max_samples=5))  # datasets.load_dataset(folder)
    assert recs == alpaca[:5]
    with pytest.raises(DataError, match="no/such/dataset: not a local file or folder"):
        D.load_records(DataSource(path="no/such/dataset"))


# ---------------------------------------------------------------------------------------------
# Eval split, dummy data, cache


def test_eval_fraction_split_is_deterministic_and_keeps_order(tmp_path, neox, alpaca):
    records = alpaca[:200]
    tr, ev = D.split_records(records, 0.1, seed=3)
    assert (len(tr), len(ev)) == (180, 20)
    assert D.split_records(records, 0.1, seed=3) == (tr, ev)
    assert D.split_records(records, 0.1, seed=4)[1] != ev
    idx = {id(r): i for i, r in enumerate(records)}
    assert sorted(idx[id(r)] for r in tr + ev) == list(range(200))
    assert [idx[id(r)] for r in tr] == sorted(idx[id(r)] for r in tr)  # original order kept

    path = write_json(tmp_path / "a.json", records)
    b = build(tmp_path, neox, seed=3, train={"path": path}, eval_fraction=0.1, max_seq_length=512)
    assert b.stats["train_records"] == 180 and b.stats["eval_records"] == b.stats["eval_rows"] == 20
    first_eval = D.ALPACA_PROMPT_NO_INPUT if not ev[0]["input"] else D.ALPACA_PROMPT
    assert b.eval[0]["input_ids"][:5] == neox(first_eval.format(**ev[0]))["input_ids"][:5]
    with pytest.raises(DataError, match="leaves no training record"):
        D.split_records(records[:1], 0.5, seed=0)


def test_dummy_data(tmp_path, neox):
    dummy = {"num_samples": 10, "seq_length": 16}
    b = build(tmp_path, neox, seed=1, dummy=dummy, max_seq_length=64)
    assert b.stats["train_rows"] == 10 and b.eval is None
    rows = list(b.train)
    assert all(len(r["input_ids"]) == 16 and r["labels"] == [IGN] + r["input_ids"][1:] for r in rows)
    assert all(0 <= t < len(neox) for r in rows for t in r["input_ids"])
    assert rows == list(build(tmp_path, neox, seed=1, dummy=dummy, max_seq_length=64).train)
    assert rows != list(build(tmp_path, neox, seed=2, dummy=dummy, max_seq_length=64).train)

    b = build(tmp_path, neox, seed=1, dummy=dummy, max_seq_length=64, packing=True, eval_fraction=0.2)
    assert [len(r["input_ids"]) for r in b.train] == [64, 64] and b.stats["eval_rows"] == 1
    assert b.train[0]["position_ids"] == list(range(16)) * 4
    assert len(build(tmp_path, neox, seed=0, dummy={"num_samples": 3}, max_seq_length=32).train[0]["input_ids"]) == 32


def test_cache_location(monkeypatch, tmp_path):
    monkeypatch.delenv("SCALETUNE_CACHE", raising=False)
    assert D.cache_root(None) == Path.home() / ".cache" / "scaletune" / "datasets"
    monkeypatch.setenv("SCALETUNE_CACHE", str(tmp_path))
    assert D.cache_root(None) == tmp_path / "datasets"
    assert D.cache_root(tmp_path / "x") == tmp_path / "x"


def test_tokenized_data_is_cached_and_reused(tmp_path, olmo, alpaca_path, monkeypatch):
    encoded = []  # records passed through the tokenizing function, per call
    real_call = D.Encoder.__call__

    def counting(self, batch):
        encoded.append(len(next(iter(batch.values()))))
        return real_call(self, batch)

    monkeypatch.setattr(D.Encoder, "__call__", counting)
    src = {"path": str(alpaca_path), "max_samples": 100}
    first = build(tmp_path, olmo, train=src, max_seq_length=256, packing=True)
    assert sum(encoded) > 100
    files = sorted(p for p in (tmp_path / "cache").iterdir())
    mtimes = [p.stat().st_mtime_ns for p in files]
    assert [f["filename"] for f in first.train.cache_files] == [str(p) for p in files if "packed" in p.name]

    encoded.clear()
    second = build(tmp_path, olmo, train=src, max_seq_length=256, packing=True)
    assert sum(encoded) <= 1  # only the up-front check of the first record: the map read the cache
    assert sorted((tmp_path / "cache").iterdir()) == files and [p.stat().st_mtime_ns for p in files] == mtimes
    assert second.train.cache_files == first.train.cache_files
    assert second.stats == first.stats and second.train[:5] == first.train[:5]

    encoded.clear()
    build(tmp_path, olmo, train=src, max_seq_length=128, packing=True)  # another key: tokenized again
    assert sum(encoded) > 100 and len(list((tmp_path / "cache").iterdir())) == 2 * len(files)


def test_the_stage_line_says_the_data_in_words(tmp_path, neox, alpaca):
    """The summary the trainer prints names the counts of the built data, not a JSON dict."""
    from scaletune.data.build import describe_stats

    short = {"instruction": "Say hi.", "input": "", "output": "Hi!"}
    long_prompt = {"instruction": " ".join(["word"] * 80), "input": "", "output": "ok"}  # dropped at 64
    path = write_json(tmp_path / "a.json", [short, alpaca[4], long_prompt])
    b = build(tmp_path, neox, train={"path": path}, max_seq_length=64)
    tokens = sum(len(r["input_ids"]) for r in b.train)
    trained = sum(sum(1 for t in r["labels"] if t != -100) for r in b.train)
    line = describe_stats(b.stats)
    assert line == (
        f"train: 3 records, {len(b.train)} examples (1 truncated, 1 dropped), {len(b.train)} rows, "
        f"{tokens:,} tokens ({trained:,} trained)"
    )
    assert "{" not in line


def test_the_first_records_of_a_json_list_are_read_without_holding_the_rest():
    """`json_records(..., limit)` (a preview's first 5,000 records, a run's max_samples) reads every
    record, so a broken file is still refused, but holds only the first `limit`: 50,000 `{"i": 1}`
    records (450 KB of text; held whole, 22 times that as Python objects, measured) in under 4 times the
    text. Without a limit the whole list is returned (the control: the same first records)."""
    import tracemalloc

    from scaletune.data.sources import json_records

    raw = b"[" + b",".join([b'{"i": 1}'] * 50_000) + b"]"
    tracemalloc.start()
    try:
        first = json_records(raw, "many.json", 5)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert first == [{"i": 1}] * 5
    assert peak < 4 * len(raw), f"{peak:,} bytes traced for {len(raw):,} bytes of JSON"
    whole = json_records(raw, "many.json", None)
    assert whole[:5] == first and len(whole) == 50_000
    with pytest.raises(DataError, match=r"broken.json:1: not valid JSON: expected ',' or '\]' after record 3"):
        json_records(b'[{"a": 1}, {"a": 2}, {"a": 3} {"a": 4}]', "broken.json", 1)
