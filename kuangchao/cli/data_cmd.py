"""``kc data prepare CONFIG``: tokenize a job's data files (text, or sft records) into its ``data.cache_dir`` once,
before the job. ``kc data prepare PATH --out DIR``: your own text from scratch (issue 39) — a training and a
held-out part, a BPE tokenizer, the tokenized cache and a config to start from
(:mod:`kuangchao_core.data.prepare_corpus`). ``kc data shapes DIR``: write the generated image set of the vision demo
(issue 31).

Exit 0 with the entry (built now or already there), 2 for a config without a cache directory or with data that is not
cached (the synthetic corpus), or bad options, 1 for data that cannot be read (the reader's message).
"""

from __future__ import annotations

import time

import typer

data_app = typer.Typer(help="Prepare a job's data before it runs.", no_args_is_help=True)
_SET_HELP = "Override one setting, e.g. --set data.cache_dir=/data/cache (repeatable; the value is read as YAML)."


@data_app.command("prepare")
def prepare(
    file: str = typer.Argument(
        ..., help="A job config (.yaml/.yml), or a text file or folder to prepare (with --out)."
    ),
    set_: list[str] = typer.Option([], "--set", help=_SET_HELP),
    out: str = typer.Option(
        None, "--out", help="PATH mode: the directory the parts, tokenizer, cache and config go to."
    ),
    heldout: float = typer.Option(0.05, "--heldout", help="PATH mode: the last share of each file's bytes held out."),
    vocab_size: int = typer.Option(4096, "--vocab-size", help="PATH mode: the BPE tokenizer's vocabulary (>= 257)."),
    preset: str = typer.Option(None, "--preset", help="PATH mode: model.preset (default: by the training bytes)."),
    seq_len: int = typer.Option(None, "--seq-len", help="PATH mode: data.seq_len (default: half the preset's)."),
    name: str = typer.Option("my-text", "--name", help="PATH mode: task.name of the config written."),
    fmt: str = typer.Option("auto", "--format", help="PATH mode: auto (by extension), txt or jsonl (data.format)."),
) -> None:
    """Tokenize the config's data files into ``data.cache_dir`` (every rank and later run of the job reads it); the
    held-out files (``data.eval_path``) too. Given a text file or folder and ``--out``: split it, train a tokenizer,
    tokenize both parts and write ``OUT/config.yaml``."""
    if not file.endswith((".yaml", ".yml")):
        if out is None:
            typer.echo(f"kc data prepare {file}: --out: give the directory to prepare the data in", err=True)
            raise typer.Exit(2)
        _prepare_corpus(file, out, heldout, vocab_size, preset, seq_len, name, fmt)
        return
    from kuangchao_core.config import load_config
    from kuangchao_core.data.cache import cached_corpus, cached_sft
    from kuangchao_core.data.tokenizer import get_tokenizer
    from kuangchao_core.errors import ConfigError, DataError
    from kuangchao_core.models.llama import config_from_model_section

    try:
        cfg = load_config(file, set_)
    except ConfigError as exc:
        for path, message in exc.errors:
            typer.echo(f"{file}: {path}: {message}", err=True)
        raise typer.Exit(2) from None
    data = cfg.data
    if not data.cache_dir:
        typer.echo(f"{file}: data.cache_dir: not set; give the directory the tokenized corpus goes to", err=True)
        raise typer.Exit(2)
    if data.is_synthetic:
        typer.echo(f"{file}: data: the synthetic corpus is generated, not cached; nothing to prepare", err=True)
        raise typer.Exit(2)
    # an operator's tool on local files: the filesystem's permissions apply, not a job's capability token
    from kuangchao_core.perm.guard_api import AllowAll, install_guard

    previous = install_guard(AllowAll())
    vocab = config_from_model_section(cfg.model).vocab_size
    tokenizer = get_tokenizer(data.tokenizer, vocab)
    parts = [("data.path", data)] + (
        [("data.eval_path", data.model_copy(update={"path": data.eval_path}))] if data.eval_path else []
    )
    try:
        for field, section in parts:
            t0 = time.perf_counter()
            if data.format == "sft":
                _, meta = cached_sft(section, tokenizer, vocab, data.cache_dir)
                what = f"{meta['num_documents']:,} examples, {meta['num_tokens']:,} tokens"
                dropped = meta["report"].get("dropped_too_long", 0)
                what += f" ({dropped} too long, dropped)" if dropped else ""
            else:
                _, _, meta = cached_corpus(section, tokenizer, vocab, data.cache_dir)
                what = f"{meta['num_tokens']:,} tokens, {meta['num_documents']:,} documents"
            how = "built" if meta["built"] else "already there"
            typer.echo(
                f"OK {field}: {data.cache_dir}/{meta['key']}: {what} from {len(meta['files'])} file(s) "
                f"({how}, {time.perf_counter() - t0:.1f} s)"
            )
    except DataError as exc:
        typer.echo(f"{file}: {exc}", err=True)
        raise typer.Exit(1) from None
    finally:
        install_guard(previous)


def _prepare_corpus(
    source: str,
    out: str,
    heldout: float,
    vocab_size: int,
    preset: str | None,
    seq_len: int | None,
    name: str,
    fmt: str,
) -> None:
    """``kc data prepare PATH --out DIR``: the report of :func:`~kuangchao_core.data.prepare_corpus.prepare_corpus`."""
    from kuangchao_core.data.prepare_corpus import prepare_corpus
    from kuangchao_core.errors import DataError
    from kuangchao_core.perm.guard_api import AllowAll, install_guard

    previous = install_guard(AllowAll())  # an operator's tool on local files, as for a config
    t0 = time.perf_counter()
    try:
        r = prepare_corpus(
            source, out, heldout=heldout, vocab_size=vocab_size, preset=preset, seq_len=seq_len, name=name, fmt=fmt
        )
    except DataError as exc:
        typer.echo(f"kc data prepare {source}: {exc}", err=True)
        raise typer.Exit(1) from None
    finally:
        install_guard(previous)
    typer.echo(f"split {len(r['files'])} file(s): {r['rule']}")
    typer.echo(f"tokenizer {r['tokenizer']}: byte-level BPE, {r['vocab_size']} tokens (trained on the training part)")
    typer.echo(
        f"cache {r['cache_dir']}: {r['tokens']['train']:,} training and {r['tokens']['heldout']:,} held-out tokens"
    )
    typer.echo(
        f"OK {r['config']}: model.preset {r['preset']} (by {r['preset_chosen_by']}), data.seq_len {r['seq_len']}, "
        f"train.steps {r['steps']} ({time.perf_counter() - t0:.1f} s); next: kc config validate {r['config']}"
    )


@data_app.command("shapes")
def shapes(
    out_dir: str = typer.Argument(..., help="Directory the images, train.jsonl and heldout.jsonl are written to."),
    train: int = typer.Option(2048, "--train", help="Training images (four question records each)."),
    heldout: int = typer.Option(64, "--heldout", help="Held-out images, none equal to a training image."),
    seed: int = typer.Option(0, "--seed"),
    size: int = typer.Option(32, "--size", help="Side of the images in pixels (the vision tower's image_size)."),
) -> None:
    """Generate the coloured-shapes image set with its questions and answers (``kuangchao_core.data.shapes``)."""
    from kuangchao_core.data.shapes import make_shape_set
    from kuangchao_core.errors import DataError

    try:
        meta = make_shape_set(out_dir, train, heldout, seed, size)
    except DataError as exc:
        typer.echo(f"kc data shapes: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(
        f"OK {out_dir}: {meta['images']['train']} training images ({meta['records']['train']} records), "
        f"{meta['images']['heldout']} held-out images ({meta['records']['heldout']} records)"
    )


def register(app: typer.Typer) -> None:
    """Add ``kc data`` to the CLI."""
    app.add_typer(data_app, name="data")
