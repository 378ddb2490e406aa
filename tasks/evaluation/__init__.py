"""The parts of the `eval` stage (`tasks/eval.py`), one module per job:

- `config`: the stage's config schema (models, perplexity, chat_loss, preference, gates, expect);
- `models`: each model entry resolved to local folders (a folder, or a training stage's artifact);
- `data`: held-out texts, conversations and preference pairs, read from shards or records;
- `engine`: a model loaded as lm-eval's HFLM, perplexity, chat loss, control generations;
- `preference_accuracy`: held-out preference accuracy of policies and reward models;
- `lmeval_tasks`: lm-eval task folders (data paths made absolute), checked and run;
- `scoring`: each measurement of one model gathered for the Result and the reports;
- `gates`: gates between models and expected bands;
- `reports`: comparison.md / .html, metrics.json, control generations, metrics.png;
- `tracking`: the reports attached to the stage's MLflow run.

No module here defines a `STAGE`, so stage discovery (tasks/__init__.py) passes this package by.
"""
