"""The form over the YAML (issue 23, "A form over the YAML"): the shipped examples, the model
choices the policy allows, the form <-> YAML round trip against the CLI's override path, problems
that name the key (not the service's copy of the config), and the form in a real headless Chromium.

Controls: each example's dry run (it passes, or fails only because its model folder is not built,
and then passes once the model is given); the policy's own check of each listed (and unlisted)
folder; `config.read_config` with the overrides a person would type for the same change."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import yaml

from scaletune.config import read_config
from scaletune.serve.edge.auth import create_token
from scaletune.serve.edge.policy import Policy
from scaletune.serve.page.form import FIELDS
from tests.helpers import wait_for
from tests.serve.serve_helpers import REPO_ROOT, Server, client, dom, headless_chromium

EXAMPLES = sorted((REPO_ROOT / "examples").glob("*.yaml"))
# The one reason an example may fail its dry run here: its model folder is built by a command it
# names in its header (scaletune init-model olmo2-tiny -o runs/models/olmo2-tiny).
UNBUILT = "model.name_or_path 'runs/models/olmo2-tiny': no such file or folder"


def dry_run(c, config: str, overrides: list[str] = ()):
    return c.post("/api/jobs", json={"config": config, "overrides": list(overrides), "dry_run": True})


def test_examples_are_listed_and_pass_the_dry_run(server, tiny_model_dir):
    assert EXAMPLES, "the repository ships examples/*.yaml"
    with client(server, server.read) as r, client(server, server.submit) as c:
        listed = r.get("/api/examples").json()
        assert [e["name"] for e in listed] == [p.stem for p in EXAMPLES]
        for entry, path in zip(listed, EXAMPLES, strict=True):
            text = path.read_text()
            first = text.splitlines()[0].lstrip("# ").strip()
            assert entry["description"].startswith(first), (entry, first)
            got = r.get(f"/api/examples/{entry['name']}").json()
            assert got["config"] == text
            out = dry_run(c, got["config"])
            if out.status_code == 422:  # only the stated reason, and with the model given it passes
                assert all(UNBUILT in p for p in out.json()["problems"]), (path.name, out.json())
                out = dry_run(c, got["config"], [f"model.name_or_path={tiny_model_dir}"])
            assert out.status_code == 200, (path.name, out.text)
            assert out.json()["plan"]["strategy"], out.json()
        assert r.get("/api/examples/nonexistent").status_code == 404
        assert r.get("/api/examples/..%2Fpyproject").status_code == 404


def test_models_listing_is_what_the_policy_allows(tmp_path, tiny_model_dir):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    shutil.copytree(tiny_model_dir, allowed / "m1")
    shutil.copytree(tiny_model_dir, allowed / "a" / "b" / "m2")
    (allowed / "notes").mkdir()
    shutil.copytree(tiny_model_dir, outside / "m3")
    (allowed / "link").symlink_to(outside / "m3")  # inside by name, outside in fact
    srv = Server(f"sqlite:///{tmp_path / 'db.sqlite'}", allowed / "jobs", policy=Policy(read_roots=(str(allowed),)))
    shutil.copytree(tiny_model_dir, allowed / "jobs" / "abc" / "final")  # another job's files
    try:
        with client(srv, None) as c:  # no token yet: the loopback admin
            models = c.get("/api/models").json()
            local = sorted(m["value"] for m in models if m["kind"] == "local")
            assert local == sorted([str(allowed / "m1"), str(allowed / "a" / "b" / "m2")]), local
            kinds = {m["value"]: m["kind"] for m in models}
            assert kinds["smollm2-135m-instruct"] == "pretrained" and kinds["llama-3-8b"] == "preset"
            # The control: the policy's own check on a dry run of each folder.
            base = yaml.safe_dump({"model": {"name_or_path": "x"}, "data": {"dummy": {}}})
            for folder in [allowed / "m1", allowed / "link", outside / "m3", allowed / "jobs" / "abc" / "final"]:
                out = dry_run(c, base, [f"model.name_or_path={folder}"])
                refused = any(p.startswith("policy: model.name_or_path") for p in out.json().get("problems", []))
                assert refused == (str(folder) not in local), (folder, out.json())
    finally:
        srv.stop()


def test_fields_apply_fields_is_the_identity_on_each_example(server):
    with client(server, server.read) as c:
        for path in EXAMPLES:
            for world in (1, 2):
                text = path.read_text()
                fields = c.post("/api/config/fields", json={"config": text, "world_size": world}).json()["fields"]
                assert set(fields) == set(FIELDS) and fields["method"] in ("full", "lora", "qlora"), fields
                applied = c.post(
                    "/api/config/apply", json={"config": text, "fields": fields, "world_size": world}
                ).json()
                again = c.post("/api/config/fields", json={"config": applied["config"], "world_size": world}).json()
                assert again["fields"] == applied["fields"] == fields, path.name
                # The config is unchanged too (only its comments and layout went).
                assert read_config(None, data=yaml.safe_load(applied["config"])).config == read_config(path).config


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_apply_gives_the_config_the_cli_overrides_give(server, path, tmp_path):
    """The same change made in the form and typed on the command line load to one config."""
    text = path.read_text()
    data = yaml.safe_load(text)
    form = {
        "training.learning_rate": 1e-4,
        "method": "qlora",
        "training.micro_batch_size": 2,
        "gradient_accumulation": 3,
        "data.max_seq_length": 96,
        "training.sample_prompts": ["Say: hello", "yes"],
        "training.max_steps": None,
        "data.train.path": "examples/data/alpaca_400.json",
    }
    typed = [
        "training.learning_rate=1e-4",
        "training.micro_batch_size=2",
        "training.global_batch_size=6",
        "data.max_seq_length=96",
        'training.sample_prompts=["Say: hello", "yes"]',
        "training.max_steps=null",
        "data.train.path=examples/data/alpaca_400.json",
        "model.quantization={bits: 4}",
    ]
    if not data["model"].get("lora"):
        typed.append("model.lora={r: 16, alpha: 32, dropout: 0.05}")
    with client(server, server.read) as c:
        out = c.post("/api/config/apply", json={"config": text, "fields": form}).json()
    assert out["fields"]["method"] == "qlora" and out["fields"]["gradient_accumulation"] == 3, out["fields"]
    (tmp_path / "form.yaml").write_text(out["config"])
    from_form, from_cli = read_config(tmp_path / "form.yaml"), read_config(path, typed)
    assert from_form.problems == from_cli.problems == []
    assert from_form.config == from_cli.config
    assert from_form.config.model.quantization.bits == 4 and from_form.config.training.global_batch_size == 6
    # The overrides the answer lists give it too.
    assert read_config(path, out["overrides"]).config == from_form.config


def test_form_refusals_and_problems_name_the_key(server):
    text = (REPO_ROOT / "examples" / "quickstart.yaml").read_text()
    with client(server, server.submit) as c:
        bad = c.post("/api/config/apply", json={"config": text, "fields": {"method": "dora", "a..b": 1}})
        assert bad.status_code == 422 and len(bad.json()["problems"]) == 2, bad.json()
        broken = c.post("/api/config/fields", json={"config": "model: [unclosed"})
        assert broken.status_code == 422 and broken.json()["problems"][0].startswith("config:"), broken.json()
        # A schema problem in the text: the submitted text's line and the key, not the job folder's copy.
        zero = text.replace("micro_batch_size: 8", "micro_batch_size: 0")
        line = zero.splitlines().index("  micro_batch_size: 0") + 1
        problems = dry_run(c, zero).json()["problems"]
    assert problems == [f"config:{line}: training.micro_batch_size: Input should be greater than or equal to 1"]
    assert not any(str(server.home) in p or "config.yaml" in p for p in problems)


def test_the_form_in_the_browser(server, tmp_path):
    """Load an example, change the learning rate and the method: the YAML follows and the plan
    preview changes; a micro-batch of 0 is shown beside its field."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    shots = Path(os.environ.get("SCALETUNE_SCREENSHOT_DIR") or tmp_path)
    token = create_token(server.svc.Session, "submit", "form-browser")
    driver = headless_chromium(tmp_path / "profile")
    try:
        driver.get(server.url + "/login")
        driver.find_element(By.ID, "token").send_keys(token)
        driver.find_element(By.ID, "login").click()
        wait_for(lambda: len(dom(driver, "#f-example option")) > 1, 30, "the examples listed")
        Select(driver.find_element(By.ID, "f-example")).select_by_value("quickstart")
        driver.find_element(By.ID, "f-load-example").click()
        wait_for(lambda: dom(driver, "#f-lr", prop="value") == ["0.002"], 30, "the fields of the example")
        assert dom(driver, "#f-method", prop="value") == ["lora"]
        memory = wait_for(lambda: dom(driver, "[data-plan=memory]"), 60, "the plan preview")[0]
        assert dom(driver, "[data-plan=strategy]")[0].startswith("single")

        def yaml_text() -> dict:
            return yaml.safe_load(dom(driver, "#config", prop="value")[0])

        lr = driver.find_element(By.ID, "f-lr")
        lr.clear()
        lr.send_keys("0.0005")
        wait_for(lambda: yaml_text()["training"]["learning_rate"] == 0.0005, 30, "the learning rate in the YAML")
        Select(driver.find_element(By.ID, "f-method")).select_by_value("full")
        wait_for(lambda: yaml_text()["model"]["lora"] is None, 30, "LoRA off in the YAML")
        wait_for(lambda: dom(driver, "[data-plan=memory]") not in ([memory], []), 60, "the plan of full fine-tuning")
        assert yaml_text()["training"]["learning_rate"] == 0.0005  # the earlier change kept
        driver.execute_script("document.getElementById('plan').scrollIntoView({block: 'end'})")
        driver.save_screenshot(str(shots / "page-form-plan.png"))

        micro = driver.find_element(By.ID, "f-micro-batch")
        micro.clear()
        micro.send_keys("0")
        wait_for(lambda: dom(driver, '.field-problem[data-for="f-micro-batch"]') != [""], 60, "the field's problem")
        beside = dom(driver, '.field-problem[data-for="f-micro-batch"]')[0]
        assert "training.micro_batch_size" in beside and "greater than or equal to 1" in beside, beside
        assert dom(driver, "#f-micro-batch", "aria-invalid") == ["true"]
        assert dom(driver, '.field-problem[data-for="f-lr"]') == [""] and dom(driver, "#f-lr", "aria-invalid") == [
            "false"
        ]
        assert any(beside in t for t in dom(driver, "#problems li")), dom(driver, "#problems li")
        assert not any("config.yaml" in t or str(server.home) in t for t in dom(driver, "#problems li"))
        assert yaml_text()["training"]["micro_batch_size"] == 0
        driver.save_screenshot(str(shots / "page-form-problem.png"))
        # At a phone's width the fields reflow into the screen (none reaches past its right edge).
        driver.set_window_size(390, 844)
        wide = driver.execute_script(
            """return [...document.querySelectorAll('#form [data-key], #config, #plan dl')]
              .filter(e => e.getBoundingClientRect().right > window.innerWidth + 1).map(e => e.id || e.tagName)"""
        )
        assert wide == [], wide
        driver.execute_script("document.getElementById('f-model').scrollIntoView()")
        driver.save_screenshot(str(shots / "page-form-phone.png"))
    finally:
        driver.quit()


def test_using_a_file_sets_its_format_and_drops_what_described_the_example_data(server, tmp_path):
    """Issue 39 (1): "Use this file" sends the form's `data_file` {path, format}. On the quickstart
    (alpaca records of two files rendered as chat turns, `template: chat`, the first 96): a chat
    file's format is set, and `template` (alpaca's only) and `max_samples` (sized for the example's
    data) go, every other key staying; an alpaca file keeps `template: chat` (a choice for the
    instruct model, not the data); a file of no format's keys keeps the format. The format field
    alone, set to another format than alpaca, takes `template` out too. The control:
    `config.read_config` with the overrides the answer lists gives the config of the YAML."""
    path = REPO_ROOT / "examples" / "quickstart.yaml"
    text = path.read_text()
    before = yaml.safe_load(text)
    own = str(tmp_path / "own.jsonl")  # apply only names it (the dry run reads it: test_page_data.py)
    with client(server, server.read) as c:

        def apply(fields: dict):
            return c.post("/api/config/apply", json={"config": text, "fields": fields})

        out = apply({"data_file": {"path": own, "format": "messages"}}).json()
        after = yaml.safe_load(out["config"])
        assert after["data"] == {**before["data"], "train": {"path": own, "format": "messages"}}
        assert {k: v for k, v in after.items() if k != "data"} == {k: v for k, v in before.items() if k != "data"}
        assert out["fields"]["data.train.format"] == "messages"
        (tmp_path / "form.yaml").write_text(out["config"])
        assert read_config(path, out["overrides"]).config == read_config(tmp_path / "form.yaml").config
        kept = {"template": "chat"}
        train = yaml.safe_load(apply({"data_file": {"path": own, "format": "alpaca"}}).json()["config"])["data"][
            "train"
        ]
        assert train == {"path": own, "format": "alpaca", **kept}
        train = yaml.safe_load(apply({"data_file": {"path": own, "format": None}}).json()["config"])["data"]["train"]
        assert train == {"path": own, "format": "alpaca", **kept}
        train = yaml.safe_load(apply({"data.train.format": "text"}).json()["config"])["data"]["train"]
        assert train == {**{k: v for k, v in before["data"]["train"].items() if k != "template"}, "format": "text"}
        for bad in ({"path": own, "format": "sharegpt"}, {"format": "messages"}, "own.jsonl"):
            r = apply({"data_file": bad})
            assert r.status_code == 422 and r.json()["problems"][0].startswith("data_file"), r.json()
        # The defaults of the fields the YAML does not set come from the nested schema.
        fields = c.post("/api/config/fields", json={"config": "model: {name_or_path: x}"}).json()
        assert fields["fields"]["data.train.format"] is None and fields["defaults"]["data.train.format"] == "alpaca"
