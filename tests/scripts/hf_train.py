"""Tiny Hugging Face models (built from configs, offline) as pipeline bodies, for the tests of lightning_pipe.models.

:func:`tiny` builds each architecture small and seeded (dropout off: the pipeline draws its own random numbers),
:func:`batches` makes padded token batches with targets, and :func:`main` trains one through PipeStrategy
(a case of tests/jobs.py: ``{"script": "hf", "arch": ..., ...}``), writing OUT/final.ckpt and OUT/result.json.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

VOCAB, TIME, WIDTH, BLOCKS = 48, 12, 32, 4
ARCHS = ("gpt2", "llama", "mistral", "qwen2", "bert")

DEFAULTS: dict[str, Any] = {"arch": "gpt2", "tied": False, "attn": "sdpa", "devices": 2, "balance": [3, 3],
                            "microbatches": 4, "schedule": "gpipe", "last_stage_loss": False, "optimizer": "sgd",
                            "samples": 32, "batch_size": 8, "epochs": 2, "seed": 7, "checkpoint": "except_last",
                            "clip": None, "pretrained": False, "lora": None, "frozen": [], "unfreeze_at": None,
                            "freeze_at": None, "state_dict_type": "full", "accumulate": 1, "resume": None,
                            "unfreeze_on_replica": None, "tensor_parallel_size": 1}


def tiny(arch: str, tied: bool = False, attn: str = "sdpa", seed: int = 0) -> nn.Module:
    """A small ``arch`` model with ``BLOCKS`` blocks, seeded; ``tied``: the head's weight is the embedding's.
    Mistral attends within a sliding window of 4 tokens, Qwen2's last two layers too (``layer_types``)."""
    import transformers as tf

    torch.manual_seed(seed)
    decoder = dict(hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=BLOCKS, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=tied,
                   pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if arch == "gpt2":
        config: Any = tf.GPT2Config(n_embd=WIDTH, n_layer=BLOCKS, n_head=4, vocab_size=VOCAB, n_positions=64,
                                    tie_word_embeddings=tied, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                    bos_token_id=1, eos_token_id=2)
        cls: Any = tf.GPT2LMHeadModel
    elif arch == "llama":
        config, cls = tf.LlamaConfig(**decoder), tf.LlamaForCausalLM
    elif arch == "mistral":
        config, cls = tf.MistralConfig(**decoder, sliding_window=4), tf.MistralForCausalLM
    elif arch == "qwen2":
        config = tf.Qwen2Config(**decoder, use_sliding_window=True, sliding_window=4, max_window_layers=2)
        cls = tf.Qwen2ForCausalLM
    elif arch == "bert":
        if tied:
            raise ValueError("BertModel has no head to tie")
        config = tf.BertConfig(hidden_size=WIDTH, num_hidden_layers=BLOCKS, num_attention_heads=4,
                               intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64,
                               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        cls = tf.BertModel
    else:
        raise ValueError(f"unknown arch {arch!r} (known: {ARCHS})")
    config._attn_implementation = attn
    return cls(config).train()


def with_lora(model: nn.Module, where: str, seed: int = 0) -> nn.Module:
    """``model`` (a tiny Llama) with PEFT's LoRA adapters (rank 4) on the attention's query and value projections
    of every block (``where="all"``) or of the last block only (``"last"``), the base frozen: the model PEFT
    adapts in place (``peft_model.base_model.model``)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed + 1)
    layers = None if where == "all" else [BLOCKS - 1]
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                        layers_to_transform=layers)
    return get_peft_model(model, config).base_model.model


def build(c: dict[str, Any]) -> nn.Module:
    """The Hugging Face model a case trains: tiny, with LoRA adapters where ``c["lora"]`` says."""
    model = tiny(c["arch"], c["tied"], c["attn"], c["seed"])
    return model if c["lora"] is None else with_lora(model, c["lora"], c["seed"])


def set_trainable(body: nn.Module, prefixes: list[str], flag: bool) -> None:
    """``requires_grad`` of the body's parameters whose names start with one of ``prefixes``."""
    for name, p in body.named_parameters():
        if name.startswith(tuple(prefixes)):
            p.requires_grad_(flag)


def trainable_changes(c: dict[str, Any], body: nn.Module, step: int) -> None:
    """The parameters named by ``c["frozen"]`` frozen from the start (trainable until ``c["freeze_at"]`` where
    that is given), unfrozen at optimizer step ``c["unfreeze_at"]``, frozen at ``c["freeze_at"]``."""
    if step == 0 and c["freeze_at"] is None:
        set_trainable(body, c["frozen"], False)
    if step == c["unfreeze_at"]:
        set_trainable(body, c["frozen"], True)
    if step == c["freeze_at"]:
        set_trainable(body, c["frozen"], False)


def output(model: nn.Module, ids: Tensor, mask: Tensor | None = None) -> Tensor:
    """The Hugging Face model's main output: logits, or the last hidden state of an encoder."""
    out = model(input_ids=ids, attention_mask=mask)
    logits = getattr(out, "logits", None)
    return out.last_hidden_state if logits is None else logits


def batches(arch: str, samples: int, seed: int = 123) -> TensorDataset:
    """``(input_ids, attention_mask, target)`` samples: every third padded on the right, every third on the
    left; targets are next tokens (decoders) or random vectors (BERT)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (samples, TIME), generator=g)
    mask = torch.ones_like(ids)
    for i in range(samples):
        cut = 1 + i % (TIME // 2)
        if i % 3 == 1:
            mask[i, TIME - cut:] = 0
        elif i % 3 == 2:
            mask[i, :cut] = 0
    ids = ids.masked_fill(mask == 0, 0)
    if arch == "bert":
        target = torch.randn(samples, TIME, WIDTH, generator=g)
    else:
        target = torch.randint(3, VOCAB, (samples, TIME), generator=g)
    return TensorDataset(ids, mask, target)


def loss_fn(out: Tensor, target: Tensor) -> Tensor:
    """Cross-entropy of the logits against token targets, or the squared error of hidden states: a mean over
    samples of equal size, so the mean of the micro-batches' losses is the batch's."""
    if target.is_floating_point():
        return nn.functional.mse_loss(out, target)
    return nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())


def optimizer(config: dict[str, Any], params: Any) -> torch.optim.Optimizer:
    """SGD with momentum, or AdamW: the same in the pipeline and in plain training."""
    if config["optimizer"] == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)  # larger: float rounding shows (1e-5)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def parameters(c: dict[str, Any], module: nn.Module) -> list[nn.Parameter]:
    """What the optimizer takes: the adapters alone under LoRA (the base is frozen for good), else every
    parameter (frozen ones too: they train once unfrozen, as docs/limitations.md advises)."""
    return [p for p in module.parameters() if p.requires_grad or c["lora"] is None]


def train_plain(config: dict[str, Any]) -> nn.Module:
    """The Hugging Face model itself trained on one device, as the pipeline trains its body."""
    config = c = {**DEFAULTS, **config}
    model = build(c) if not c["pretrained"] else tiny(c["arch"], c["tied"], c["attn"], c["seed"] + 100)
    body = to_sequential_of(model)
    opt = optimizer(config, parameters(c, model))
    data = batches(config["arch"], config["samples"])
    replicas = config["devices"] // (len(config["balance"]) * config["tensor_parallel_size"])
    # With replicas, each draws its share of a permutation seeded as Lightning seeds its DistributedSampler: one
    # device sees their union, in batches as large as all of theirs together.
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=config["seed"]) \
        if replicas > 1 else None
    step = 0
    for epoch in range(config["epochs"]):
        if sampler is not None:
            sampler.set_epoch(epoch)
        for k, (ids, mask, target) in enumerate(DataLoader(data, config["batch_size"] * replicas, sampler=sampler)):
            trainable_changes(c, body, step)
            loss = loss_fn(output(model, ids, mask), target) / c["accumulate"]
            loss.backward()
            if (k + 1) % c["accumulate"]:
                continue
            if config["clip"] is not None:  # a tied parameter counted once, as model.parameters() lists it
                torch.nn.utils.clip_grad_norm_(model.parameters(), config["clip"])
            opt.step()
            opt.zero_grad()
            step += 1
    return model


def to_sequential_of(model: nn.Module) -> nn.Sequential:
    """The body of ``model`` (its own modules)."""
    from lightning_pipe.models import to_sequential

    return to_sequential(model)


class HFBody(pl.LightningModule):
    """A tiny Hugging Face model's body (``to_sequential``) trained on its batches."""

    def __init__(self, config: dict[str, Any], pretrained: str | None = None) -> None:
        super().__init__()
        from lightning_pipe.models import pretrained_body, to_sequential

        self.config = {**DEFAULTS, **config}
        c = self.config
        if pretrained is not None:  # built on meta; each stage reads its own tensors from the checkpoint
            self.sequential_module = pretrained_body(pretrained, attn_implementation=c["attn"])
        else:
            self.sequential_module = to_sequential(build(c))
        trainable_changes(c, self.sequential_module, 0)  # frozen as the model is built, before fitting starts

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        apart = self.config.get("unfreeze_on_replica")  # (a test of the refusal: one replica alone changes)
        if apart is None or self.global_rank == apart:
            trainable_changes(self.config, self.sequential_module, self.trainer.global_step)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        import lightning_pipe

        ids, mask, target = batch
        if self.config["last_stage_loss"]:
            return lightning_pipe.loss_on_last_stage(self.sequential_module, (ids, mask), target, loss_fn)
        return loss_fn(self.sequential_module((ids, mask)), target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return optimizer(self.config, parameters(self.config, self))


def main(config: dict[str, Any], out: str) -> None:
    """Train :class:`HFBody` through PipeStrategy; write OUT/final.ckpt and, from the main process,
    OUT/result.json."""
    from lightning_pipe import PipeStrategy

    c = {**DEFAULTS, **config}
    pl.seed_everything(c["seed"])
    pretrained = None
    if c["pretrained"]:  # the checkpoint to fine-tune: seed + 100's model, as train_plain starts from
        pretrained = os.path.join(out, "pretrained")
        written = f"{pretrained}.tmp{os.getpid()}"  # every process runs this: the first complete copy stays
        tiny(c["arch"], c["tied"], c["attn"], c["seed"] + 100).save_pretrained(written)
        if os.path.exists(os.path.join(written, "config.json")):
            try:
                os.rename(written, pretrained)
            except OSError:
                shutil.rmtree(written)
        else:  # once a process group exists, transformers writes on its rank 0 alone (an earlier case made one)
            shutil.rmtree(written, ignore_errors=True)
            deadline = time.monotonic() + 120
            while not os.path.exists(os.path.join(pretrained, "config.json")):
                assert time.monotonic() < deadline, f"no process wrote {pretrained}"
                time.sleep(0.1)
    model = HFBody(c, pretrained)
    plan = None
    if c.get("plan_without"):  # the body's own plan less these entries (their layers kept whole)
        own = model.sequential_module.tensor_parallel_plan
        plan = {k: v for k, v in own.items() if k not in c["plan_without"]}
        assert len(plan) == len(own) - len(c["plan_without"]), f"{c['plan_without']} not all in the plan {own}"
    strategy = PipeStrategy(balance=c["balance"], microbatches=c["microbatches"], checkpoint=c["checkpoint"],
                            schedule=c["schedule"], rpc_timeout_sec=60, sharding_strategy=c.get("sharding", "NO_SHARD"),
                            state_dict_type=c["state_dict_type"], tensor_parallel_size=c["tensor_parallel_size"],
                            tensor_parallel_plan=plan, start_method=c.get("start_method", "popen"))
    trainer = pl.Trainer(accelerator="cpu", devices=c["devices"], strategy=strategy, max_epochs=c["epochs"],
                         logger=False, enable_progress_bar=False, enable_checkpointing=False,
                         enable_model_summary=False, default_root_dir=out, gradient_clip_val=c["clip"],
                         accumulate_grad_batches=c["accumulate"])
    resume = os.path.join(os.path.dirname(out), c["resume"]) if c.get("resume") else None  # another case's
    trainer.fit(model, DataLoader(batches(c["arch"], c["samples"]), batch_size=c["batch_size"]), ckpt_path=resume)
    trainer.save_checkpoint(os.path.join(out, "final.ckpt"))
    result: dict[str, Any] = {"global_step": trainer.global_step}
    if c["tied"]:
        result["tied"] = [list(t.names) for t in model.sequential_module.tied]
    # (a stage sharded over its replicas or split over tensor ranks holds a slice of its copy: not compared here)
    if c["tied"] and c.get("sharding", "NO_SHARD") == "NO_SHARD" and c["tensor_parallel_size"] == 1:
        result.update(tied_copies(model.sequential_module, os.path.join(out, "final.ckpt")))
    if c["tensor_parallel_size"] > 1:  # the most each process held while it built its stage (on meta: layer by layer)
        body = trainer.strategy._body
        with open(os.path.join(out, f"built_replica{trainer.global_rank}.json"), "w") as f:
            json.dump([body.built, *[s["built"] for s in body.hosts.call("stats")]], f)
    if trainer.is_global_zero:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(result, f)


def tied_copies(body: Any, checkpoint: str) -> dict[str, Any]:
    """How far each remote copy of a tied parameter is from the driver's, after training and after loading the
    checkpoint with that parameter changed (it must reach every copy); the number of tensors the file holds for
    it."""
    state = torch.load(checkpoint, weights_only=True)["state_dict"]
    (tied,) = body.tied
    names = [n.removeprefix(body.name + ".") for n in tied.names]

    def gaps() -> list[float]:
        remote = {k: v for part in body.hosts.call("state_dict") for k, v in part.items()}
        mine = dict(body.named_parameters(remove_duplicate=False))[names[0]].detach()
        return [float((remote[n] - mine).abs().max()) for n in tied.names[1:]]

    trained = gaps()
    keys = [f"sequential_module.{n}" for n in names]
    stored = len({state[k].untyped_storage().data_ptr() for k in keys})
    changed = state[keys[0]] + 1.0
    for k in keys:
        state[k] = changed  # one tensor under every name, as the file holds it
    body.load_state_dict({k.removeprefix("sequential_module."): v for k, v in state.items()})
    loaded = gaps()
    remote = {k: v for part in body.hosts.call("state_dict") for k, v in part.items()}
    reached = [float((remote[n] - changed).abs().max()) for n in tied.names[1:]]
    return {"tied_gap_trained": trained, "tied_gap_loaded": loaded, "tied_loaded_error": reached,
            "tied_storages": stored}
