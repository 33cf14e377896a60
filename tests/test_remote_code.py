"""A saved folder carries its modeling code: it loads with trust_remote_code=True where hf_posenc cannot import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
import transformers
from conftest import FOX_PRO, VOCAB, WITHOUT_HF_POSENC, make_config, make_model, random_ids


LOAD_WITHOUT_HF_POSENC = WITHOUT_HF_POSENC + textwrap.dedent(
    """
    import traceback
    failed = []
    for folder, auto_names in zip(sys.argv[1::2], sys.argv[2::2]):  # folder, "AutoA,AutoB", folder, ...
        try:
            ids = torch.load(folder + "/ids.pt")
            for name in auto_names.split(","):
                model = getattr(transformers, name).from_pretrained(folder, trust_remote_code=True).eval()
                assert model.__class__.__module__.startswith("transformers_modules."), model.__class__.__module__
                with torch.no_grad():
                    output = model(ids)
                logits = output.logits if hasattr(output, "logits") else output.last_hidden_state
                torch.save(logits, f"{folder}/{name}.pt")
                if name == "AutoModelForCausalLM":  # the loaded code's KV cache under this Transformers
                    greedy = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
                    cached = model.generate(ids, use_cache=True, **greedy)
                    uncached = model.generate(ids, use_cache=False, **greedy)
                    assert torch.equal(cached, uncached), "cached generate differs"
                print(name, type(model).__name__)
        except Exception:
            traceback.print_exc()
            with open(folder + "/error.txt", "w") as error:
                error.write(traceback.format_exc())
            failed.append(folder)
    sys.exit(f"failed: {', '.join(failed)}" if failed else 0)
    """
)

SAVE_WITH_HF_POSENC = textwrap.dedent(
    """
    import json, sys
    import torch, transformers
    import hf_posenc
    folder, family, kwargs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    config_class = hf_posenc.PosEncBertConfig if family == "bert" else hf_posenc.PosEncGPT2Config
    auto_class = transformers.AutoModelForMaskedLM if family == "bert" else transformers.AutoModelForCausalLM
    torch.manual_seed(0)
    model = auto_class.from_config(config_class(**kwargs)).eval()
    model.save_pretrained(folder)
    ids = torch.load(folder + "/ids.pt")
    with torch.no_grad():
        torch.save(model(ids).logits, folder + "/expected.pt")
    print(transformers.__version__)
    """
)
OTHER_PYTHON = os.environ.get("HF_POSENC_OTHER_PYTHON")


REMOTE_CASES = [
    ("bert", "t5", "l2", "AutoModelForMaskedLM,AutoModel"),
    ("gpt2", "rope", "softmax", "AutoModelForCausalLM,AutoModel"),
    ("gpt2", "alibi", "l2", "AutoModelForCausalLM"),
    ("gpt2", "rope", {"type": "swish_l2", "toeplitz_gate": True}, "AutoModelForCausalLM"),
    ("bert", "learned", "softmax", "AutoModelForMaskedLM"),
    ("gpt2", "fire", "softmax", "AutoModelForCausalLM"),
    ("gpt2", "fox", "softmax", "AutoModelForCausalLM"),
    ("gpt2", FOX_PRO, "softmax", "AutoModelForCausalLM"),
    ("gpt2", {"type": "path", "forget_gate": True}, "softmax", "AutoModelForCausalLM"),  # PaTH-FoX
    ("gpt2", {"type": "wall", "use_scalar_gate": True}, "softmax", "AutoModelForCausalLM"),
    ("gpt2", {"type": "selective_rope", "use_gate": True}, "softmax", "AutoModelForCausalLM"),
    ("bert", "pope", "softmax", "AutoModelForMaskedLM"),
    ("gpt2", "none", "stick_breaking", "AutoModelForCausalLM"),
    ("gpt2", "rope", "ssmax", "AutoModelForCausalLM"),
    ("bert", "alibi", {"type": "softmax", "sink": "learned"}, "AutoModelForMaskedLM"),
    ("bert", ["rope", "t5"], "softmax", "AutoModelForMaskedLM"),  # a scheme per layer
    ("gpt2", ["alibi", "fox"], "softmax", "AutoModelForCausalLM"),
]


@pytest.fixture(scope="session")
def loaded_without_hf_posenc(tmp_path_factory) -> tuple[list, subprocess.CompletedProcess]:
    """Every case of ``REMOTE_CASES`` saved in its folder, then loaded in one interpreter where hf_posenc cannot
    import (one start-up for all): ``[(folder, model)]`` in the order of the cases, and the loader's result. A folder
    whose loading failed holds the traceback in ``error.txt``. Session-scoped: under xdist a worker meets this
    module's tests between other modules', and a module-scoped fixture would be rebuilt at each return."""
    saved, arguments = [], []
    for index, (family, scheme, normalizer, auto_names) in enumerate(REMOTE_CASES):
        folder = tmp_path_factory.mktemp(f"remote_{index}")
        model = make_model(family, scheme, normalizer, attn="sdpa")
        model.save_pretrained(folder)
        torch.save(random_ids(2, 9), folder / "ids.pt")
        saved.append((folder, model))
        arguments += [str(folder), auto_names]
    command = [sys.executable, "-c", LOAD_WITHOUT_HF_POSENC, *arguments]
    return saved, subprocess.run(command, capture_output=True, text=True, cwd=saved[0][0], timeout=600)


@pytest.mark.parametrize(("family", "scheme", "normalizer", "auto_names"), REMOTE_CASES)
def test_saved_model_loads_as_remote_code_without_hf_posenc(
    family, scheme, normalizer, auto_names, loaded_without_hf_posenc
):
    saved, result = loaded_without_hf_posenc
    folder, model = saved[REMOTE_CASES.index((family, scheme, normalizer, auto_names))]
    config = json.loads((folder / "config.json").read_text())
    modeling_file = f"modeling_posenc_{family}"
    assert config["auto_map"]["AutoConfig"] == "configuration_posenc.Pos" + (
        "EncBertConfig" if family == "bert" else "EncGPT2Config"
    )
    assert config["auto_map"]["AutoModel"].startswith(modeling_file + ".")
    assert (folder / f"{modeling_file}.py").is_file() and (folder / "position_encodings.py").is_file()
    assert not (folder / "error.txt").is_file(), (folder / "error.txt").read_text()[-3000:]
    assert result.returncode == 0 or "failed: " in result.stderr, result.stderr[-3000:]  # not one folder's failure
    ids = torch.load(folder / "ids.pt")
    with torch.no_grad():
        expected_lm = model(ids).logits
        expected_base = model.base_model(ids).last_hidden_state
    for name in auto_names.split(","):
        expected = expected_base if name == "AutoModel" else expected_lm
        torch.testing.assert_close(torch.load(folder / f"{name}.pt"), expected, atol=1e-5, rtol=1e-4)


def test_saved_folder_lists_every_auto_class_of_the_family(tmp_path):
    make_model("bert").save_pretrained(tmp_path)
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert auto_map == {
        "AutoConfig": "configuration_posenc.PosEncBertConfig",
        "AutoModel": "modeling_posenc_bert.PosEncBertModel",
        "AutoModelForMaskedLM": "modeling_posenc_bert.PosEncBertForMaskedLM",
        "AutoModelForSequenceClassification": "modeling_posenc_bert.PosEncBertForSequenceClassification",
        "AutoModelForTokenClassification": "modeling_posenc_bert.PosEncBertForTokenClassification",
        "AutoModelForQuestionAnswering": "modeling_posenc_bert.PosEncBertForQuestionAnswering",
        "AutoModelForPreTraining": "modeling_posenc_bert.PosEncBertForPreTraining",
        "AutoModelForCausalLM": "modeling_posenc_bert.PosEncBertLMHeadModel",
        "AutoModelForNextSentencePrediction": "modeling_posenc_bert.PosEncBertForNextSentencePrediction",
        "AutoModelForMultipleChoice": "modeling_posenc_bert.PosEncBertForMultipleChoice",
    }


LOAD_CAUSAL_BERT_AND_LORA_WITHOUT_HF_POSENC = textwrap.dedent(
    """
    import sys
    sys.modules["hf_posenc"] = None  # any import of hf_posenc now raises ImportError
    import torch, transformers
    from peft import LoraConfig, get_peft_model
    folder = sys.argv[1]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert type(model).__name__ == "PosEncBertLMHeadModel", type(model)
    assert model.__class__.__module__.startswith("transformers_modules."), model.__class__.__module__
    ids = torch.load(folder + "/ids.pt")
    torch.save(model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False), folder + "/tokens.pt")
    lora = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM"))  # the default targets come with the code
    print(sorted(lora.peft_config["default"].target_modules))
    """
)


def test_causal_bert_loads_as_remote_code_and_takes_lora_without_hf_posenc(tmp_path):
    pytest.importorskip("peft", reason="PEFT is a test extra: pip install -e .[test]")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(make_config("bert", "alibi", is_decoder=True)).eval()
    model.save_pretrained(tmp_path)
    ids = random_ids(2, 5)
    torch.save(ids, tmp_path / "ids.pt")
    result = subprocess.run(
        [sys.executable, "-c", LOAD_CAUSAL_BERT_AND_LORA_WITHOUT_HF_POSENC, str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "['query', 'value']"
    expected = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert torch.equal(torch.load(tmp_path / "tokens.pt"), expected)


def test_push_to_hub_uploads_the_modeling_code(monkeypatch):
    """No Hub here: the Hub calls are replaced, and the folder push_to_hub would upload is inspected."""
    import transformers.utils.hub as hub

    uploaded = {}
    api = types.SimpleNamespace(create_repo=lambda repo_id, **_: types.SimpleNamespace(repo_id=repo_id))
    monkeypatch.setattr(hub, "hf_api", lambda: api)
    monkeypatch.setattr(
        hub, "create_and_tag_model_card", lambda *_, **__: types.SimpleNamespace(save=lambda path: None)
    )

    def fake_upload(self, folder, repo_id, **kwargs):
        uploaded["repo_id"] = repo_id
        uploaded["files"] = sorted(path.name for path in Path(folder).iterdir())
        uploaded["auto_map"] = json.loads((Path(folder) / "config.json").read_text())["auto_map"]

    model = make_model("gpt2", "alibi")
    monkeypatch.setattr(type(model), "_upload_modified_files", fake_upload)
    model.push_to_hub("someone/posenc-gpt2-alibi")
    assert uploaded["repo_id"] == "someone/posenc-gpt2-alibi"
    assert {"model.safetensors", "config.json", "modeling_posenc_gpt2.py", "configuration_posenc.py"} <= set(
        uploaded["files"]
    )
    assert {"position_encodings.py", "attention_normalizers.py", "posenc_attention.py"} <= set(uploaded["files"])
    assert uploaded["auto_map"]["AutoModelForCausalLM"] == "modeling_posenc_gpt2.PosEncGPT2LMHeadModel"


def run_python(python: str, script: str, *args: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        [python, "-c", script, *args], capture_output=True, text=True, cwd=cwd, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.skipif(
    OTHER_PYTHON is None,
    reason="needs a second Python environment with another Transformers version and hf_posenc installed; "
    ".ci/run sets HF_POSENC_OTHER_PYTHON to its oldest-Transformers environment",
)
@pytest.mark.parametrize("saved_by", ["this", "other"])
@pytest.mark.parametrize(
    ("family", "kwargs", "auto_name"),
    [
        ("gpt2", {"position_encoding": "rope", "attention_normalizer": "softmax"}, "AutoModelForCausalLM"),
        ("gpt2", {"position_encoding": "fox", "attention_normalizer": "l2"}, "AutoModelForCausalLM"),
        ("bert", {"position_encoding": "t5", "attention_normalizer": "ssmax"}, "AutoModelForMaskedLM"),
    ],
)
def test_folder_saved_under_one_transformers_loads_as_remote_code_under_the_other(
    family, kwargs, auto_name, saved_by, tmp_path
):
    """The modeling files a saved folder carries run on the oldest and the newest supported Transformers: a folder
    saved under either loads under the other with ``trust_remote_code=True`` and no hf_posenc, gives the saving
    model's logits, and (decoders) generates the same with and without its KV cache."""
    sizes = dict(vocab_size=VOCAB, num_hidden_layers=2, num_attention_heads=2, hidden_size=32, intermediate_size=64)
    if family == "gpt2":
        sizes = dict(vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=32, n_positions=64)
    torch.save(random_ids(2, 9), tmp_path / "ids.pt")
    saver, loader = (sys.executable, OTHER_PYTHON) if saved_by == "this" else (OTHER_PYTHON, sys.executable)
    versions = {
        python: run_python(python, "import transformers; print(transformers.__version__)", cwd=tmp_path).strip()
        for python in (saver, loader)
    }
    assert versions[saver] != versions[loader], versions
    run_python(saver, SAVE_WITH_HF_POSENC, str(tmp_path), family, json.dumps({**sizes, **kwargs}), cwd=tmp_path)
    run_python(loader, LOAD_WITHOUT_HF_POSENC, str(tmp_path), auto_name, cwd=tmp_path)
    torch.testing.assert_close(
        torch.load(tmp_path / f"{auto_name}.pt"), torch.load(tmp_path / "expected.pt"), atol=1e-5, rtol=1e-4
    )


PREVIOUS_LAYOUTS = {
    # the last commit whose saved folders carry FoX and PaTH in content_position_encodings.py
    "fox and path before data_dependent_encodings.py": (
        "bbce60fe7464cb7ae52346f3878aff9ea9679453",
        {"position_encoding": ["fox", {"type": "path", "forget_gate": True}]},
        "content_position_encodings.py",
        "data_dependent_encodings.py",
    ),
    # the last commit whose saved folders carry every normalizer in attention_normalizers.py and CoPE in
    # content_position_encodings.py
    "cope and ssmax before the normalizers' modules": (
        "efe25ace5e8ef1d6557e9e820a93eb735446fb44",
        {"position_encoding": "cope", "attention_normalizer": "ssmax"},
        "attention_normalizers.py",
        "normalizer_interface.py",
    ),
}
"""A folder saved by each earlier layout of the modules: the commit, the model, a module it carries and one it
does not."""
REPOSITORY = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("layout", list(PREVIOUS_LAYOUTS))
def test_folder_saved_by_a_previous_layout_loads_as_remote_code_and_into_this_release(layout, tmp_path):
    """A folder saved by a release whose modules were laid out otherwise (its ``hf_posenc`` taken from git) loads
    with ``trust_remote_code=True`` where hf_posenc cannot import, and into this release's classes, with the saving
    model's logits."""
    commit, model_kwargs, carried, not_carried = PREVIOUS_LAYOUTS[layout]
    has_commit = subprocess.run(
        ["git", "-C", str(REPOSITORY), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True
    )
    if has_commit.returncode != 0:
        pytest.skip(f"needs the git history holding {commit} (a full clone of the repository)")
    previous = tmp_path / "previous_release"
    previous.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(REPOSITORY), "archive", commit, "hf_posenc"], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(previous)], input=archive.stdout, check=True)
    folder = tmp_path / "saved"
    folder.mkdir()
    torch.save(random_ids(2, 9), folder / "ids.pt")
    sizes = dict(vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=32, n_positions=64)
    kwargs = {**sizes, **model_kwargs}
    env = {**os.environ, "PYTHONPATH": str(previous)}  # ahead of the installed hf_posenc
    run_python(sys.executable, SAVE_WITH_HF_POSENC, str(folder), "gpt2", json.dumps(kwargs), cwd=folder, env=env)
    assert (folder / carried).is_file()
    assert not (folder / not_carried).exists()  # saved by the previous release's code
    expected = torch.load(folder / "expected.pt")

    run_python(sys.executable, LOAD_WITHOUT_HF_POSENC, str(folder), "AutoModelForCausalLM", cwd=folder)
    torch.testing.assert_close(torch.load(folder / "AutoModelForCausalLM.pt"), expected, atol=1e-5, rtol=1e-4)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert not model.__class__.__module__.startswith("transformers_modules."), model.__class__.__module__
    with torch.no_grad():
        torch.testing.assert_close(model(torch.load(folder / "ids.pt")).logits, expected, atol=1e-5, rtol=1e-4)
