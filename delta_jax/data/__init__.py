"""Data: tfds builders over local files, grain pipelines, prompt templates, synthetic tasks."""
