"""Alpaca records through the chat template, lists of data files, prompt files and prompt
rendering of the inference package, and --help that rewraps to the terminal."""

from __future__ import annotations

import json

import pytest

from scaletune import data as D
from scaletune.config import DataConfig, DataSource
from scaletune.data.templates import CHATML_TEMPLATE
from scaletune.errors import ConfigError, DataError, UserError
from scaletune.inference import LoadedModel, prompt_text, read_prompts
from scaletune.inference.generate import encode


@pytest.fixture(scope="module")
def olmo(shared_data):
    from transformers import PreTrainedTokenizerFast

    path = shared_data / "tokenizers" / "olmo2-dolma2.json"
    return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|endoftext|>", pad_token="<|pad|>")


RECORDS = [
    {"instruction": "Name a colour.", "input": "", "output": "Blue."},
    {"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour."},
]


def test_alpaca_with_chat_template_equals_the_same_turns_as_messages(tmp_path, olmo):
    """The control is the `messages` path, tested on its own in test_data.py: an alpaca record with
    `template: chat` must give exactly the ids and labels of its user/assistant turns as messages."""
    (tmp_path / "a.json").write_text(json.dumps(RECORDS))
    turns = [
        {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]},
        {
            "messages": [
                {"role": "user", "content": "Translate to French.\n\nGood morning"},
                {"role": "assistant", "content": "Bonjour."},
            ]
        },
    ]
    (tmp_path / "m.json").write_text(json.dumps(turns))
    cache = tmp_path / "cache"
    chat = D.build_datasets(
        DataConfig(train=DataSource(path=str(tmp_path / "a.json"), template="chat"), max_seq_length=64),
        olmo,
        seed=0,
        cache_dir=cache,
    ).train
    msgs = D.build_datasets(
        DataConfig(train=DataSource(path=str(tmp_path / "m.json"), format="messages"), max_seq_length=64),
        olmo,
        seed=0,
        cache_dir=cache,
    ).train
    plain = D.build_datasets(
        DataConfig(train=DataSource(path=str(tmp_path / "a.json")), max_seq_length=64), olmo, seed=0, cache_dir=cache
    ).train
    assert chat["input_ids"] == msgs["input_ids"] and chat["labels"] == msgs["labels"]
    assert chat["input_ids"] != plain["input_ids"]  # the cache key tells the two prompt formats apart
    trained = [t for t in chat["labels"][0] if t != -100]
    assert olmo.decode(trained) == "Blue.<|im_end|>"


def test_template_chat_is_for_alpaca_records_only():
    with pytest.raises(ValueError, match="template chat applies to format alpaca only"):
        DataSource(path="x.jsonl", format="messages", template="chat")


def test_a_list_of_files_is_one_source_in_order(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(RECORDS[:1]))
    (tmp_path / "b.jsonl").write_text(json.dumps(RECORDS[1]) + "\n")
    src = DataSource(path=[str(tmp_path / "a.json"), str(tmp_path / "b.jsonl")])
    assert [r["output"] for r in D.load_records(src)] == ["Blue.", "Bonjour."]
    assert [r["output"] for r in D.load_records(src.model_copy(update={"max_samples": 1}))] == ["Blue."]
    bad = DataSource(path=[str(tmp_path / "a.json"), str(tmp_path / "missing.json"), "owner/dataset"])
    with pytest.raises(DataError) as exc:
        D.load_records(bad)
    text = str(exc.value)
    assert "missing.json: data file not found" in text and "owner/dataset: a list of paths holds local files" in text
    with pytest.raises(ConfigError):
        from scaletune.config import load_config

        load_config(None, data={"model": {"name_or_path": "m"}, "data": {"train": {"path": []}}})


def test_prompt_files_every_problem_at_once(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text(
        '{"prompt": "Hi"}\n"plain string"\n{"messages": [{"role": "user", "content": "Yo"}]}\n\n',
    )
    assert read_prompts(good) == ["Hi", "plain string", [{"role": "user", "content": "Yo"}]]
    txt = tmp_path / "p.txt"
    txt.write_text("one\n\ntwo\n")
    assert read_prompts(txt) == ["one", "two"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{not json\n{"text": "wrong field"}\n')
    with pytest.raises(UserError) as exc:
        read_prompts(bad)
    assert [p.split(":")[1] for p in exc.value.problems] == ["2", "3"]
    with pytest.raises(UserError, match="not found"):
        read_prompts(tmp_path / "none.txt")


def test_prompts_are_written_as_the_model_was_trained(olmo):
    chat = LoadedModel(None, olmo, "chat", CHATML_TEMPLATE, None, "")
    assert prompt_text(chat, "Hi") == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    # The chat template writes its own markers: the tokenizer adds nothing around them.
    assert encode(chat, "Hi") == olmo("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    alpaca = LoadedModel(None, olmo, "alpaca", CHATML_TEMPLATE, None, "")
    assert prompt_text(alpaca, "Hi") == D.alpaca_prompt("Hi")
    assert prompt_text(alpaca, [{"role": "user", "content": "Hi"}]) == D.alpaca_prompt("Hi")
    raw = LoadedModel(None, olmo, "none", CHATML_TEMPLATE, None, "")
    assert prompt_text(raw, "Once upon a time") == "Once upon a time"


def test_the_quickstart_config_is_valid_and_its_sample_prompts_are_held_out():
    """examples/quickstart.yaml says its sample prompts are not in the training data: check it, on the
    records it really reads (the list of files, cut at max_samples)."""
    from scaletune.config import load_config
    from tests.helpers import REPO_ROOT

    cfg = load_config(REPO_ROOT / "examples" / "quickstart.yaml")
    assert cfg.model.name_or_path == "smollm2-135m-instruct" and cfg.training.eval_on_start
    train = cfg.data.train
    paths = [str(REPO_ROOT / p) for p in train.path]
    records = D.load_records(train.model_copy(update={"path": paths}))
    assert len(records) == train.max_samples
    asked = {p.strip().lower() for p in cfg.training.sample_prompts}
    seen = {r["instruction"].strip().lower() for r in records}
    assert asked and not asked & seen, asked & seen
