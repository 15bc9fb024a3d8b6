"""`mlxspec train-drafter`: make teacher data once, train a head, save and register it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
from tqdm import tqdm

from mlxspec import device
from mlxspec.anatomy import Decoder, split_decoder
from mlxspec.drafter.data import DataStore, add_file, add_text, chat_prompts, self_distill
from mlxspec.drafter.head import HeadSpec, build_head, save_head
from mlxspec.drafter.train import (
    CHECKPOINT,
    HeadStudent,
    Progress,
    TrainSettings,
    choose_vocab,
    coverage,
    train,
)
from mlxspec.loading import LoadedModel
from mlxspec.registry import ModelEntry, register_proposer

HELD_OUT = "held-out"


@dataclass
class DrafterJob:
    out: Path
    data_dir: Path
    self_distill: bool = True
    prompts: int | None = None  # how many of the built-in prompts (None: all)
    text_tokens: int = 100_000
    extra_text: Path | None = None
    answer_tokens: int = 128
    vocab: int = 8192
    train: TrainSettings = None  # type: ignore[assignment]
    register: bool = True
    proposer_name: str = "head"


def _bar(description: str) -> Callable[[int, int], None]:
    """A progress callback (done, total) drawing a tqdm bar; the bar starts at the first
    report, at what an earlier run already did, so its rate counts only this run."""
    bar: list[tqdm] = []

    def update(done: int, total: int) -> None:
        if not bar:
            bar.append(tqdm(total=total, initial=done, desc=description, unit="seq"))
        bar[0].update(done - bar[0].n)
        if done >= total:
            bar[0].close()

    return update


def make_data(
    entry: ModelEntry, loaded: LoadedModel, decoder: Decoder, job: DrafterJob, say
) -> DataStore:
    """Teacher data into `job.data_dir`; what is already there is kept (resumable)."""
    store = DataStore(job.data_dir, entry.target, decoder.norm.weight.shape[0])
    tokenizer = loaded.tokenizer
    held_out = chat_prompts(held_out=True)[: job.prompts]
    if store.done(HELD_OUT) < len(held_out):
        say(f"held-out answers for measuring acceptance ({len(held_out)} prompts)")
        self_distill(
            loaded.model,
            tokenizer,
            decoder,
            store,
            held_out,
            HELD_OUT,
            job.answer_tokens,
            progress=_bar("held-out"),
        )
    if job.self_distill:
        prompts = chat_prompts()[: job.prompts]
        if store.done("self-distill") < len(prompts):
            say(f"the target answers {len(prompts)} prompts (self-distillation; resumable)")
            self_distill(
                loaded.model,
                tokenizer,
                decoder,
                store,
                prompts,
                "self-distill",
                job.answer_tokens,
                progress=_bar("self-distill"),
            )
    if job.text_tokens and store.tokens("text") < job.text_tokens:
        say(f"teacher states on up to {job.text_tokens} tokens of offline documentation")
        add_text(decoder, tokenizer, store, job.text_tokens, progress=_bar("text"))
    if job.extra_text is not None:
        add_file(decoder, tokenizer, store, job.extra_text, progress=_bar(job.extra_text.name))
    return store


def train_drafter(entry: ModelEntry, loaded: LoadedModel, job: DrafterJob, say) -> dict:
    """The whole job; returns the training record that is also saved with the head."""
    started = time.perf_counter()
    decoder = split_decoder(loaded.model)
    store = make_data(entry, loaded, decoder, job, say)
    training = [s for src in ("self-distill", "text", "file") for s in store.shards(src)]
    answers = store.shards("self-distill") or training
    eval_shards = store.shards(HELD_OUT)
    vocab_size = decoder.embed.weight.shape[0]
    vocab = choose_vocab(answers, job.vocab, vocab_size, set(loaded.tokenizer.eos_token_ids))
    spec = HeadSpec(
        hidden_size=decoder.norm.weight.shape[0],
        vocab_size=vocab_size,
        target=entry.target,
        final_norm=True,
        feed_normed=True,
    )
    head = build_head(spec, loaded.model, vocab)
    resume = job.out / CHECKPOINT
    if resume.is_dir():
        say(f"resuming from {resume}")
    bar = tqdm(total=round(job.train.budget_minutes * 60), desc="training", unit="s")

    def report(progress: Progress, metrics: dict | None) -> None:
        bar.n = min(bar.total, round(progress.seconds))
        if metrics:
            bar.set_postfix(
                loss=metrics.get("loss", "-"),
                accept=metrics["first_token_acceptance"],
                refresh=False,
            )
        bar.refresh()

    student = HeadStudent(head, decoder, job.train.feature_weight)
    progress = train(student, training, eval_shards, job.out, job.train, report)
    bar.close()
    record = {
        "target": entry.target,
        "model": entry.name,
        "trained_on": device.describe(),
        "data": {
            "self_distill_tokens": store.tokens("self-distill"),
            "text_tokens": store.tokens("text"),
            "file_tokens": store.tokens("file"),
            "held_out_tokens": store.tokens(HELD_OUT),
        },
        "draft_vocab": int(vocab.size),
        "vocab_coverage_held_out": round(coverage(eval_shards, vocab), 4),
        "settings": asdict(job.train),
        "steps": progress.step,
        "train_seconds": round(progress.seconds, 1),
        "positions_seen": progress.positions,
        "curve": progress.curve,
        "total_seconds": round(time.perf_counter() - started, 1),
    }
    head.spec.record = record
    save_head(head, job.out)
    mx.eval(head.parameters())
    if job.register:
        path = register_proposer(
            entry.name,
            job.proposer_name,
            {"kind": "head", "path": str(job.out.resolve())},
            f"added by mlxspec train-drafter on {time.strftime('%Y-%m-%d %H:%M')}",
        )
        say(f"registered as proposer '{job.proposer_name}' of '{entry.name}' in {path}")
    return record
