"""Data: tfds builders over local files, grain pipelines, prompt templates, synthetic tasks.

    records.py        load_records(path_or_name, fields="auto", on_error="raise") -> (records, stats)
    builders.py       build_tfds_source(paths, name, data_dir) -> random-access ArrayRecord source
    pipeline.py       make_prompt_pipeline(source, batch_size, seed, ...) -> resumable batch iterator
    templates.py      PromptTemplate / make_template: "qwen_math" | "base" | "chat" | "plain"
    synthetic.py      the built-in arithmetic task (JSONL train/test splits; difficulty knobs;
                      token_classes: ground-truth token credit of a sampled response)
    tiny_tokenizer.py a <512-token byte-level BPE tokenizer for the synthetic task
    tiny_task.py      prepare_synthetic_splits / prepare_tiny_tokenizer: both of the above, made
                      once per workdir (what train.run.prepare_assets uses)

The names below are re-exported lazily, so `import delta_jax.data.synthetic` does not load
tensorflow-datasets or grain.
"""
import importlib

_EXPORTS = {
    "load_records": "records",
    "LoadStats": "records",
    "MalformedRecordError": "records",
    "last_boxed": "records",
    "build_tfds_source": "builders",
    "RecordSource": "builders",
    "make_prompt_pipeline": "pipeline",
    "PromptIterator": "pipeline",
    "PromptTemplate": "templates",
    "make_template": "templates",
    "BOXED_INSTRUCTION": "templates",
    "prepare_synthetic_splits": "tiny_task",
    "prepare_tiny_tokenizer": "tiny_task",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
