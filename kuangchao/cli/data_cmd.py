"""``kc data prepare CONFIG``: tokenize a job's text files into its ``data.cache_dir`` once, before the job.

Exit 0 with the entry (built now or already there), 2 for a config without a cache directory or with data that is not
cached (the synthetic corpus, sft records), 1 for data that cannot be read (the reader's message).
"""

from __future__ import annotations

import time

import typer

data_app = typer.Typer(help="Prepare a job's data before it runs.", no_args_is_help=True)
_SET_HELP = "Override one setting, e.g. --set data.cache_dir=/data/cache (repeatable; the value is read as YAML)."


@data_app.command("prepare")
def prepare(
    file: str = typer.Argument(..., help="Job config YAML file."),
    set_: list[str] = typer.Option([], "--set", help=_SET_HELP),
) -> None:
    """Tokenize the config's data files into ``data.cache_dir`` (every rank and later run of the job reads it)."""
    from kuangchao_core.config import load_config
    from kuangchao_core.data.cache import cached_corpus
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
    if data.is_synthetic or data.format == "sft":
        typer.echo(f"{file}: data: only text files (txt, jsonl, parquet) are cached; this job's are not", err=True)
        raise typer.Exit(2)
    # an operator's tool on local files: the filesystem's permissions apply, not a job's capability token
    from kuangchao_core.perm.guard_api import AllowAll, install_guard

    previous = install_guard(AllowAll())
    t0 = time.perf_counter()
    try:
        vocab = config_from_model_section(cfg.model).vocab_size
        tokens, _, meta = cached_corpus(data, get_tokenizer(data.tokenizer, vocab), vocab, data.cache_dir)
    except DataError as exc:
        typer.echo(f"{file}: {exc}", err=True)
        raise typer.Exit(1) from None
    finally:
        install_guard(previous)
    how = "built" if meta["built"] else "already there"
    typer.echo(
        f"OK {data.cache_dir}/{meta['key']}: {meta['num_tokens']:,} tokens, {meta['num_documents']:,} documents "
        f"from {len(meta['files'])} file(s) ({how}, {time.perf_counter() - t0:.1f} s)"
    )


def register(app: typer.Typer) -> None:
    """Add ``kc data`` to the CLI."""
    app.add_typer(data_app, name="data")
