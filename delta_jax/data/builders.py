"""A tensorflow-datasets builder over local JSONL / parquet files, read back without TensorFlow.

`build_tfds_source(paths, name, data_dir)` converts the files once into ArrayRecord shards under
`data_dir` (tfds `file_format="array_record"`) and returns a random-access data source that grain
indexes directly. tfds runs in its numpy-only mode here: both the writer and
`builder.as_data_source()` work with TensorFlow absent.

The prepared copy is cached per *content*: the builder config name is
"<name>-<16 hex digits of sha256(file bytes, field mapping, on_error)>", so editing a file
rebuilds it and re-running with the same files reuses it. Rows keep the file order
(`disable_shuffling=True`); shuffling is the pipeline's job (see pipeline.py).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import re
from typing import Any, Mapping, Sequence

import numpy as np
import tensorflow_datasets as tfds
from tensorflow_datasets.core.utils import tqdm_utils

from delta_jax.data import records as records_lib
from delta_jax.errors import InputError, MissingInputError
from delta_jax.log_utils import absl_warning_held_back

log = logging.getLogger("delta_jax.data")

DEFAULT_DATA_DIR_ENV = "DELTA_JAX_DATA_DIR"
_TEXT_KEYS = ("id", "problem", "answer", "solution", *records_lib.CONTEXT_FIELDS,
              records_lib.COLUMNS)


def default_data_dir() -> str:
    """$DELTA_JAX_DATA_DIR, else ~/.cache/delta_jax/tfds."""
    return os.environ.get(DEFAULT_DATA_DIR_ENV) or os.path.join(
        os.path.expanduser("~"), ".cache", "delta_jax", "tfds"
    )


@dataclasses.dataclass(eq=False)
class MathRecordsConfig(tfds.core.BuilderConfig):
    """Which files to read and how (see records.load_records)."""

    paths: tuple[str, ...] = ()
    fields_json: str = '"auto"'  # json.dumps of the `fields` argument
    on_error: str = "raise"
    split: str = "train"  # only for hub names
    columns_json: str = "{}"  # json.dumps of the `columns` argument


class _LocalRecordsInfo(tfds.core.DatasetInfo):
    """tfds' DatasetInfo without its look-up of pre-computed info in tfds' GCS bucket.

    A builder made before its data is prepared calls `initialize_from_bucket()`, which makes a
    `tempfile.mkdtemp("tfds")` directory for the files it would copy from GCS, then finds nothing
    (tfds keeps GCS off unless asked) and returns without removing it: one empty /tmp/tmp*tfds
    directory left behind for every new file content. These records are never on that bucket.
    """

    def initialize_from_bucket(self) -> None:
        return None


class DeltaJaxMathRecords(tfds.core.GeneratorBasedBuilder):
    """Math problems as {"id","problem","answer","solution","level","data_source","extra_info",
    "columns","index"} in one "train" split."""

    VERSION = tfds.core.Version("1.2.0")
    RELEASE_NOTES = {"1.0.0": "Records from local JSONL / parquet files (or a hub name).",
                     "1.1.0": "Each record's data_source and extra_info (text; \"\" for none).",
                     "1.2.0": "Each record's columns a reward takes by name (JSON text)."}
    # Nothing is downloaded, so there is no checksums file to find next to the code; tfds's own
    # lookup of the code path needs the optional `importlib_resources` package, which we avoid.
    code_path = None

    def _info(self) -> tfds.core.DatasetInfo:
        features = {key: tfds.features.Text() for key in _TEXT_KEYS}
        features["level"] = np.int32
        features["index"] = np.int64  # position in the concatenated input files
        return _LocalRecordsInfo(
            builder=self,
            description="Math problems with reference answers (delta_jax local records).",
            features=tfds.features.FeaturesDict(features),
            disable_shuffling=True,
            metadata=tfds.core.MetadataDict(),
        )

    # tfds prints "Downloading and preparing dataset Unknown size (download: Unknown size, ...)"
    # and "Dataset ... downloaded and prepared" to stdout around a preparation; nothing is
    # downloaded here, so one log line says what happens instead.
    def _log_download_bytes(self) -> None:
        log.info("data: converting %s to ArrayRecord once (this content's copy: %s)",
                 self.builder_config.description.removeprefix("records from "), self.data_dir)

    def _log_download_done(self) -> None:
        return None

    def _split_generators(self, dl_manager):
        del dl_manager  # local files only
        return {"train": self._generate_examples()}

    def _generate_examples(self):
        config: MathRecordsConfig = self.builder_config
        source = list(config.paths) if len(config.paths) > 1 else config.paths[0]
        recs, stats = records_lib.load_records(
            source, fields=json.loads(config.fields_json), on_error=config.on_error,
            split=config.split, columns=json.loads(config.columns_json),
        )
        if not recs:
            raise InputError(f"{config.paths}: no records to prepare (load stats: {stats})")
        # Saved with the dataset (metadata.json), so a cache hit reports the same stats.
        self.info.metadata["load_stats"] = stats.to_json()
        for index, rec in enumerate(recs):
            yield index, {**rec, "index": index}


class RecordSource:
    """Random-access records (str fields, int level/index) over a prepared tfds data source.

    Implements len() and [] (int), which is all grain.MapDataset.source needs.
    """

    def __init__(self, data_source, stats: records_lib.LoadStats, name: str, data_dir: str):
        self._source = data_source
        self.stats = stats
        self.name = name
        self.data_dir = data_dir

    def __len__(self) -> int:
        return len(self._source)

    @staticmethod
    def _decode(example: Mapping[str, Any]) -> dict:
        out = {}
        for key, value in example.items():
            if isinstance(value, bytes):
                out[key] = value.decode("utf-8")
            elif isinstance(value, np.generic):
                out[key] = value.item()
            else:
                out[key] = value
        return out

    def __getitem__(self, index: int) -> dict:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"record {index} out of range for {self.name} ({n} records)")
        return self._decode(self._source[int(index) % n])

    def __getitems__(self, indices: Sequence[int]) -> list[dict]:
        return [self._decode(e) for e in self._source.__getitems__([int(i) for i in indices])]

    def __repr__(self) -> str:
        return f"RecordSource(name={self.name!r}, len={len(self)}, data_dir={self.data_dir!r})"


def _content_digest(paths: Sequence[str], fields: Any, on_error: str, split: str,
                    columns: Mapping[str, bool]) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"fields": fields, "on_error": on_error, "split": split,
                         "columns": columns}, sort_keys=True).encode())
    for path in paths:
        h.update(b"\0file\0")
        if os.path.isfile(path):
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
        else:  # a hub name: its identity is the name itself
            h.update(path.encode())
    return h.hexdigest()[:16]


def _builder(config: MathRecordsConfig, data_dir: str) -> "DeltaJaxMathRecords":
    # tfds warns "Using custom data configuration" for each: one config per content is the design.
    with absl_warning_held_back("Using custom data configuration"):
        return DeltaJaxMathRecords(config=config, data_dir=data_dir, file_format="array_record")


def build_tfds_source(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    name: str | None = None,
    data_dir: str | os.PathLike | None = None,
    fields: str | Mapping[str, str] = "auto",
    on_error: str = "raise",
    split: str = "train",
    columns: Mapping[str, bool] | None = None,
) -> RecordSource:
    """Prepare (once per file content) and open records as a random-access ArrayRecord source.

    Args:
      paths: file(s), directory, glob (see records.resolve_paths) or a hub name "org/name".
      name: a readable prefix for the cache entry (default: the first file's stem).
      data_dir: where tfds keeps prepared data (default: default_data_dir()).
      fields, on_error, split, columns: as in records.load_records.
    Returns:
      RecordSource: len() and [i] -> {"id","problem","answer","solution","level","data_source",
      "extra_info","columns","index"}; its `.stats` is the LoadStats of the conversion.
    """
    files = records_lib.resolve_paths(paths)
    if not files:
        hub = os.fspath(paths) if isinstance(paths, (str, os.PathLike)) else ""
        if not records_lib.looks_like_hub_name(hub):
            raise MissingInputError(f"{paths}: no such file, directory or glob")
        files = [hub]
    files = [os.path.abspath(f) if os.path.exists(f) else f for f in files]
    if isinstance(fields, Mapping):
        fields = dict(fields)
    columns = dict(columns or {})
    digest = _content_digest(files, fields, on_error, split, columns)
    slug = re.sub(r"[^A-Za-z0-9_]+", "_", name or pathlib.Path(files[0]).stem).strip("_") or "records"
    config = MathRecordsConfig(
        name=f"{slug}-{digest}",
        version=DeltaJaxMathRecords.VERSION,
        description=f"records from {files[0]}" + (f" and {len(files) - 1} more" if len(files) > 1 else ""),
        paths=tuple(files),
        fields_json=json.dumps(fields, sort_keys=True),
        on_error=on_error,
        split=split,
        columns_json=json.dumps(columns, sort_keys=True),
    )
    data_dir = os.fspath(data_dir or default_data_dir())
    builder = _builder(config, data_dir)
    progress_was_on = tqdm_utils._active  # tfds only offers a global switch; restore it after
    tfds.display_progress_bar(False)
    try:
        builder.download_and_prepare()  # no-op when this content was prepared before
    except OSError:
        # Another process (e.g. another host on a shared data_dir) may have finished preparing
        # the same content first, so renaming our copy into place failed: use theirs.
        if not _builder(config, data_dir).is_prepared():
            raise
    finally:
        tfds.display_progress_bar(progress_was_on)
    # Open what is on disk now. The builder above read the dataset info when it was made: if
    # another process finished preparing the content after that, download_and_prepare found it
    # there and did nothing, and that builder still holds the empty info of before (no splits).
    builder = _builder(config, data_dir)
    stats = records_lib.LoadStats.from_json(builder.info.metadata.get("load_stats", {}))
    return RecordSource(builder.as_data_source(split="train"), stats, config.name, data_dir)
