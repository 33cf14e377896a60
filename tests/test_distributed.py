"""Sharded training with torch's FSDP2 (``torch.distributed.fsdp.fully_shard``): two CPU processes over gloo.

One ``torch.multiprocessing`` spawn of two processes runs every case (tiny models, a few steps), rank 0 returns what it
gathered, and the tests compare it with one unsharded process (this one) on the same global batch:

* training: each rank takes half of every global batch; the mean loss and the gathered weights equal one process on
  the whole batch (plain SGD, so the weights follow the gradients exactly);
* saving: the full state dict gathered by ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` saves with
  ``save_pretrained`` called on the sharded model, as accelerate's users do, and reloads with ``from_pretrained``;
* resuming: a sharded ``torch.distributed.checkpoint`` (``dcp.save`` / ``dcp.load`` of model and AdamW state) resumes
  to the weights of the uninterrupted run;
* the ``pretrain`` recipe under accelerate's FSDP2: saving the model and ``save_state`` / ``load_state``
  (``--checkpointing_steps``, ``--resume_from_checkpoint``) with either state-dict type. accelerate 1.15 turns FSDP on
  only for GPU-type setups (``AcceleratorState`` leaves a multi-CPU run as ``MULTI_CPU``), so here the processes get
  the environment ``accelerate launch`` exports for an FSDP2 config, and the recipe's ``Accelerator`` is marked as an
  FSDP run after it is built; from there on accelerate's own code runs: ``fsdp2_prepare_model`` wraps the model,
  ``get_state_dict`` gathers it, ``save_fsdp_model`` / ``load_fsdp_model`` and the optimizer counterparts checkpoint.
  FSDP through accelerate on GPUs is not run by these tests.
"""

from __future__ import annotations

import json
import math
import os
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import transformers
from conftest import make_model, write_corpus_slice
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard

import hf_posenc
from hf_posenc_recipes import common as recipe_common
from hf_posenc_recipes import pretrain as pretrain_recipe


WORLD_SIZE = 2
GLOBAL_BATCH, LENGTH = 4, 12
SGD_STEPS, SGD_LR = 3, 0.2
# (family, position encoding, attention normalizer, config overrides): the schemes whose tables every layer shares
# (tupe, fox's gates, cope; recurrent and floater build their table once per forward), content terms per layer (shaw,
# deberta, xlnet), and normalizers with parameters (ssmax, a learned sink) or none. FLOATER solves with a fixed-step
# method: an adaptive one (dopri5, its default) picks its steps from error estimates, so the rounding of a half batch's
# gradients against a whole batch's can change the steps and the table by more than rounding.
CASES = {
    "gpt2-learned-exp": ("gpt2", "learned", "exp", {}),
    "gpt2-rope-softmax-untied": ("gpt2", "rope", "softmax", {"tie_word_embeddings": False}),
    "gpt2-t5-l2": ("gpt2", "t5", "l2", {}),
    "gpt2-fox-stick_breaking": ("gpt2", "fox", "stick_breaking", {}),
    "gpt2-cope-sigmoid": ("gpt2", "cope", "sigmoid", {}),
    "gpt2-xlnet-ssmax": ("gpt2", "xlnet", "ssmax", {}),
    "gpt2-recurrent-relu2": ("gpt2", "recurrent", "relu2", {}),
    "gpt2-tupe-softmax_sink": ("gpt2", "tupe", {"type": "softmax", "sink": "learned"}, {}),
    "bert-shaw-softmax": ("bert", "shaw", "softmax", {}),
    "bert-deberta-l2": ("bert", "deberta", "l2", {}),
    "bert-tupe-softpick": ("bert", "tupe", "softpick", {}),
    "bert-floater_rk4-softmax": ("bert", {"type": "floater", "method": "rk4"}, "softmax", {}),
}
RESUME_CASES = {"gpt2-fox-softmax": ("gpt2", "fox", "softmax", {}), "bert-tupe-ssmax": ("bert", "tupe", "ssmax", {})}
ADAMW_STEPS, ADAMW_SPLIT, ADAMW_LR = 4, 2, 1e-2
RECIPE_RUNS = {  # state-dict type -> the recipe's model flags and the layer class accelerate wraps
    "SHARDED_STATE_DICT": (["--task", "clm", "--position_encoding", "fox"], "PosEncGPT2Block"),
    "FULL_STATE_DICT": (["--task", "clm", "--position_encoding", "t5"], "PosEncGPT2Block"),
}
MLM_RUNS = {  # masked LMs under accelerate's FSDP2: the recipe's flags and the layer class accelerate wraps
    "posenc_bert-shaw": (["--task", "mlm", "--position_encoding", "shaw"], "PosEncBertLayer"),
    "retrofit_bert-t5": (["--task", "mlm", "--trust_remote_code"], "RetrofitBertLayer"),  # + --model_name_or_path
}
RECIPE_SIZE_FLAGS = ["--hidden_size", "32", "--num_hidden_layers", "2", "--num_attention_heads", "2"]
RECIPE_FLAGS = [
    "--block_size", "16", "--learning_rate", "3e-3", "--num_warmup_steps", "2", "--max_eval_blocks", "8",
    "--eval_steps", "6", "--max_train_steps", "6",
]  # fmt: skip
RECIPE_CHECKPOINT = 3
CORPUS_LINES = 1000


def recipe_corpus(root: Path) -> list[str]:
    """``--train_file`` for every recipe run of this file: the embedded corpus's first ``CORPUS_LINES`` lines (56 kB),
    which each run tokenises in each process; the whole corpus (0.9 MB) would only add time."""
    return ["--train_file", str(root / "corpus.txt")]


def global_batch(step: int) -> dict[str, torch.Tensor]:
    """The global batch of a step: token ids, scored everywhere (so each half has the same number of scored
    tokens, and the mean over the batch is the mean of the halves' means)."""
    ids = torch.randint(3, 61, (GLOBAL_BATCH, LENGTH), generator=torch.Generator().manual_seed(100 + step))
    return {"input_ids": ids, "labels": ids.clone()}


def rank_half(batch: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    rows = GLOBAL_BATCH // WORLD_SIZE
    return {name: tensor[rank * rows : (rank + 1) * rows] for name, tensor in batch.items()}


def build(case: tuple, seed: int = 0) -> transformers.PreTrainedModel:
    family, scheme, normalizer, overrides = case
    return make_model(family, scheme, normalizer, seed=seed, **overrides).train()


def shard_per_block(model: transformers.PreTrainedModel) -> None:
    """``fully_shard`` in place as the transformer-based wrap policy does: every ``_no_split_modules`` block a group,
    then the root, whose group holds the rest (embeddings, head, the scheme's tables shared by every layer).

    FSDP2 manages a parameter in one group only (torch 2.13 refuses a parameter that another group manages too). Tied
    input and output embeddings are one parameter, so a block that holds the input embedding (BERT's
    ``PosEncBertEmbeddings``, as stock BERT's ``BertEmbeddings``, is in ``_no_split_modules``) stays with the root,
    beside the head that shares it: what accelerate does when ``fsdp_transformer_layer_cls_to_wrap`` names the layer
    class alone. accelerate 1.15 then also carves the input embedding, the head and the final norm into one more group
    (the recipe's test runs that); BERT's masked-LM head holds its decoder's bias a second time
    (``cls.predictions.bias``), which that group would split: the recipe shards a masked LM as here
    (``shard_masked_lm_for_fsdp2``)."""
    input_embeddings = model.get_input_embeddings()
    tied = input_embeddings.weight is model.get_output_embeddings().weight
    blocks = [
        module
        for module in model.modules()
        if type(module).__name__ in model._no_split_modules
        and not (tied and any(child is input_embeddings for child in module.modules()))
    ]
    for block in blocks:
        fully_shard(block)
    fully_shard(model)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole state dict on rank 0 (empty on the others), on the CPU."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def mean_over_ranks(loss: torch.Tensor) -> float:
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / WORLD_SIZE


def train_sharded_with_sgd(case: tuple, rank: int, folder: Path) -> dict:
    """SGD steps on this rank's half of the global batch; the gathered weights, saved with ``save_pretrained``."""
    model = build(case)
    shard_per_block(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    losses = []
    for _ in range(SGD_STEPS):
        loss = model(**rank_half(global_batch(0), rank)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(mean_over_ranks(loss))
    weights = full_state_dict(model)
    model.save_pretrained(folder, state_dict=dict(weights), is_main_process=rank == 0)  # it empties the dict
    return {"losses": losses, "weights": weights, "groups": sum(isinstance(m, FSDPModule) for m in model.modules())}


def adamw_steps(model, optimizer, rank: int, steps: range) -> None:
    """AdamW steps on this rank's half of the global batches of ``steps``."""
    for step in steps:
        model(**rank_half(global_batch(step), rank)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def resume_from_sharded_checkpoint(case: tuple, rank: int, folder: Path) -> dict:
    """AdamW, checkpointed with ``dcp.save`` after ``ADAMW_SPLIT`` steps: the uninterrupted run, and a model built
    from another seed that loads the checkpoint with ``dcp.load`` and runs the remaining steps."""
    model = build(case)
    shard_per_block(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=ADAMW_LR)
    adamw_steps(model, optimizer, rank, range(ADAMW_SPLIT))
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder)
    adamw_steps(model, optimizer, rank, range(ADAMW_SPLIT, ADAMW_STEPS))
    uninterrupted = full_state_dict(model)

    resumed = build(case, seed=1)
    shard_per_block(resumed)
    optimizer = torch.optim.AdamW(resumed.parameters(), lr=ADAMW_LR)
    model_state, optimizer_state = get_state_dict(resumed, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(resumed, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    adamw_steps(resumed, optimizer, rank, range(ADAMW_SPLIT, ADAMW_STEPS))
    return {"uninterrupted": uninterrupted, "resumed": full_state_dict(resumed)}


def fsdp2_recipe_accelerator(args, **kwargs):
    """The recipe's ``Accelerator``, marked as the FSDP run that ``accelerate launch`` makes of an FSDP2 config on
    GPUs (on CPU accelerate keeps it ``MULTI_CPU``); its FSDP plugin reads the ``FSDP_*`` variables, as there."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    accelerator = recipe_common.recipe_accelerator(args, **kwargs)
    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin()
    # as AcceleratorState does for FSDP: in both shared states, since every AcceleratorState() copies PartialState's
    accelerator.state.distributed_type = PartialState().distributed_type = DistributedType.FSDP
    return accelerator


def pretrain_under_fsdp2(flags: list[str], layer_class: str, state_dict_type: str, folder: Path) -> None:
    """The recipe with checkpoints (``accelerator.save_state``), then resumed from the middle one."""
    os.environ.update(
        ACCELERATE_USE_FSDP="true",
        FSDP_VERSION="2",
        FSDP_AUTO_WRAP_POLICY="TRANSFORMER_BASED_WRAP",
        FSDP_TRANSFORMER_CLS_TO_WRAP=layer_class,
        FSDP_STATE_DICT_TYPE=state_dict_type,
        FSDP_RESHARD_AFTER_FORWARD="true",
    )
    sizes = [] if "--model_name_or_path" in flags else RECIPE_SIZE_FLAGS  # a checkpoint fixes its sizes
    common = [*sizes, *RECIPE_FLAGS, *flags, "--per_device_train_batch_size", "4"]
    pretrain_recipe.main(
        [*common, "--checkpointing_steps", str(RECIPE_CHECKPOINT), "--output_dir", str(folder / "whole")]
    )
    checkpoint = folder / "whole" / f"step_{RECIPE_CHECKPOINT}"
    pretrain_recipe.main(
        [*common, "--resume_from_checkpoint", str(checkpoint), "--output_dir", str(folder / "resumed")]
    )


def run_worker(rank: int, port: int, root: Path) -> None:
    """One of the two processes: every case in turn; rank 0 writes what it gathered to ``root / "results.pt"``."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2"
    )
    os.environ.update(LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    # a rank that fails leaves the other waiting in a collective: it fails too, after this timeout
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=120))
    results = {"sgd": {}, "resume": {}}
    for name, case in CASES.items():
        results["sgd"][name] = train_sharded_with_sgd(case, rank, root / "saved" / name)
    for name, case in RESUME_CASES.items():
        results["resume"][name] = resume_from_sharded_checkpoint(case, rank, root / "dcp" / name)
    pretrain_recipe.recipe_accelerator = fsdp2_recipe_accelerator
    for state_dict_type, (flags, layer_class) in RECIPE_RUNS.items():
        folder = root / "recipe" / state_dict_type
        pretrain_under_fsdp2([*flags, *recipe_corpus(root)], layer_class, state_dict_type, folder)
    # the recipe's masked LMs under accelerate's FSDP2, sharded checkpoints
    for name, (flags, layer_class) in MLM_RUNS.items():
        source = ["--model_name_or_path", str(root / "mlm" / "retrofitted")] if name.startswith("retrofit") else []
        flags = [*flags, *source, *recipe_corpus(root)]
        pretrain_under_fsdp2(flags, layer_class, "SHARDED_STATE_DICT", root / "mlm" / name)
    if rank == 0:
        torch.save(results, root / "results.pt")
    dist.destroy_process_group()


def retrofitted_bert_folder(folder: Path) -> None:
    """A stock ``BertForMaskedLM`` switched to ``t5`` by ``hf_posenc.retrofit``, saved with the recipe's byte
    tokenizer (and its mask token) for ``--model_name_or_path``."""
    tokenizer = pretrain_recipe.load_tokenizer(None, "mlm")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    hf_posenc.retrofit(transformers.BertForMaskedLM(config), position_encoding="t5").save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> tuple[Path, dict]:
    """The two processes, started once for every test of this file (a start costs the imports of both): their folder
    and rank 0's results."""
    root = tmp_path_factory.mktemp("fsdp2")
    write_corpus_slice(root / "corpus.txt", lines=CORPUS_LINES)
    retrofitted_bert_folder(root / "mlm" / "retrofitted")
    mp.spawn(run_worker, args=(free_port(), root), nprocs=WORLD_SIZE)
    return root, torch.load(root / "results.pt")


@pytest.fixture(scope="module")
def sharded_masked_lm(sharded) -> Path:
    """The folder of the masked-LM recipe runs, made by the processes of ``sharded``."""
    return sharded[0] / "mlm"


def assert_same_weights(actual: dict, expected: dict, **tolerance) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(
            actual[name], tensor, msg=lambda message, name=name: f"{name}: {message}", **tolerance
        )


@pytest.mark.parametrize("name", CASES)
def test_sharded_sgd_equals_one_process_on_the_global_batch(sharded, name):
    case, result = CASES[name], sharded[1]["sgd"][name]
    layers = make_model(case[0]).config.num_hidden_layers
    assert result["groups"] == layers + 1  # the layers and the root
    model = build(case)
    optimizer = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    losses = []
    for _ in range(SGD_STEPS):
        loss = model(**global_batch(0)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]  # the steps train
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(losses), atol=1e-5, rtol=1e-4)
    assert_same_weights(result["weights"], model.state_dict(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", CASES)
def test_gathered_state_dict_saves_and_reloads(sharded, name):
    """``save_pretrained`` on the sharded model with the gathered weights: a folder that loads with ``from_pretrained``
    and names the library's classes, not the ``FSDP<Name>`` class that ``fully_shard`` swaps in, in ``auto_map``."""
    root, results = sharded
    case = CASES[name]
    folder = root / "saved" / name
    family = case[0]
    auto = transformers.AutoModelForMaskedLM if family == "bert" else transformers.AutoModelForCausalLM
    reloaded = auto.from_pretrained(folder).eval()
    reference = build(case).eval()
    reference.load_state_dict(results["sgd"][name]["weights"])
    class_name = type(reference).__name__
    module = f"modeling_posenc_{family}"
    assert type(reloaded).__name__ == class_name
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"][auto.__name__] == f"{module}.{class_name}" and config["architectures"] == [class_name]
    assert (folder / f"{module}.py").is_file() and not list(folder.glob("_fsdp*.py"))
    ids = global_batch(SGD_STEPS)["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, reference(input_ids=ids).logits)
    assert (reloaded.get_input_embeddings().weight is reloaded.get_output_embeddings().weight) == (not case[3])


@pytest.mark.parametrize("name", RESUME_CASES)
def test_sharded_checkpoint_resumes_to_the_uninterrupted_weights(sharded, name):
    """Exactly the same weights, though the resumed model was built from other weights (seed 1); AdamW's moments come
    from the checkpoint too (fresh moments would take other steps)."""
    case, result = RESUME_CASES[name], sharded[1]["resume"][name]
    assert_same_weights(result["resumed"], result["uninterrupted"], atol=0, rtol=0)
    unloaded = build(case, seed=1).state_dict()
    assert any(not torch.equal(unloaded[key], tensor) for key, tensor in result["resumed"].items())


@pytest.mark.parametrize("state_dict_type", list(RECIPE_RUNS))
def test_pretrain_recipe_saves_and_resumes_under_accelerate_fsdp2(sharded, state_dict_type):
    folder = sharded[0] / "recipe" / state_dict_type
    whole, resumed = folder / "whole", folder / "resumed"
    checkpoint = whole / f"step_{RECIPE_CHECKPOINT}"
    if state_dict_type == "SHARDED_STATE_DICT":  # accelerate's save_fsdp_model: a DCP folder per model / optimizer
        assert (checkpoint / "pytorch_model_fsdp_0" / ".metadata").is_file()
        assert (checkpoint / "optimizer_0" / ".metadata").is_file()
    else:
        assert (checkpoint / "pytorch_model_fsdp.bin").is_file() and (checkpoint / "optimizer.bin").is_file()
    logs = [
        [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()] for run in (whole, resumed)
    ]
    assert [r["step"] for r in logs[0]] == list(range(1, 7)) and [r["step"] for r in logs[1]] == [4, 5, 6]
    assert [r["loss"] for r in logs[1]] == [r["loss"] for r in logs[0]][RECIPE_CHECKPOINT:]
    weights = [load_file(run / "model.safetensors") for run in (whole, resumed)]
    assert_same_weights(weights[1], weights[0], atol=0, rtol=0)
    flags = RECIPE_RUNS[state_dict_type][0]
    one = pretrain_recipe.main(  # one process on the global batch (2 x 4 blocks), no accelerate FSDP
        [*RECIPE_SIZE_FLAGS, *RECIPE_FLAGS, *flags, *recipe_corpus(sharded[0]), "--per_device_train_batch_size", "8"]
        + ["--output_dir", str(folder / "one")]
    )
    ones = [json.loads(line)["loss"] for line in (folder / "one" / "train_log.jsonl").read_text().splitlines()]
    torch.testing.assert_close(torch.tensor([r["loss"] for r in logs[0]]), torch.tensor(ones), atol=2e-4, rtol=0)
    assert json.loads((whole / "results.json").read_text())["eval_loss"] == pytest.approx(one["eval_loss"], abs=2e-4)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(whole)  # the recipe's runs are causal LMs
    assert type(reloaded) is hf_posenc.PosEncGPT2LMHeadModel
    auto_map = json.loads((whole / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModelForCausalLM"] == "modeling_posenc_gpt2.PosEncGPT2LMHeadModel"
    saved = {name: tensor for name, tensor in reloaded.state_dict().items() if name in weights[0]}  # tied: one copy
    assert_same_weights(saved, weights[0], atol=0, rtol=0)


@pytest.mark.parametrize("name", list(MLM_RUNS))
def test_pretrain_recipe_trains_and_resumes_a_masked_lm_under_accelerate_fsdp2(sharded_masked_lm, name):
    """The recipe shards a masked LM itself (``shard_masked_lm_for_fsdp2``: the layers, then the root with the head,
    its bias held twice and the tied embedding), which accelerate's FSDP2 preparation then takes as it is: it trains,
    checkpoints with accelerate's sharded ``save_state`` and resumes to the same losses and weights."""
    whole, resumed = sharded_masked_lm / name / "whole", sharded_masked_lm / name / "resumed"
    checkpoint = whole / f"step_{RECIPE_CHECKPOINT}"
    assert (checkpoint / "pytorch_model_fsdp_0" / ".metadata").is_file()
    assert (checkpoint / "optimizer_0" / ".metadata").is_file()
    logs = [
        [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()] for run in (whole, resumed)
    ]
    assert [r["step"] for r in logs[0]] == list(range(1, 7)) and [r["step"] for r in logs[1]] == [4, 5, 6]
    assert [r["loss"] for r in logs[1]] == [r["loss"] for r in logs[0]][RECIPE_CHECKPOINT:]
    assert all(math.isfinite(r["loss"]) for r in logs[0])
    weights = [load_file(run / "model.safetensors") for run in (whole, resumed)]
    assert_same_weights(weights[1], weights[0], atol=0, rtol=0)
    reloaded = transformers.AutoModelForMaskedLM.from_pretrained(whole, trust_remote_code=True)
    start = (
        transformers.AutoModelForMaskedLM.from_pretrained(sharded_masked_lm / "retrofitted", trust_remote_code=True)
        if name.startswith("retrofit")
        else None
    )
    saved = {key: tensor for key, tensor in reloaded.state_dict().items() if key in weights[0]}
    assert_same_weights(saved, weights[0], atol=0, rtol=0)
    head = reloaded.cls.predictions
    assert head.decoder.bias is head.bias and head.decoder.weight is reloaded.get_input_embeddings().weight
    if start is not None:  # the retrofitted model trained from its saved weights, and is still the retrofitted class
        assert type(reloaded).__name__ == type(start).__name__ == "RetrofitBertForMaskedLM"
        moved = reloaded.state_dict()["cls.predictions.transform.dense.weight"]
        assert not torch.equal(moved, start.state_dict()["cls.predictions.transform.dense.weight"])
