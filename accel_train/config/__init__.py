"""The run's configuration, torch-free, importing nothing else of accel_train: every other part reads it from here.

    schema.py     the tree of typed dataclasses (`Config` and its sections), one field a line with its help text
    load.py       YAML file <- dotted key=value overrides, checked on load; `--help`'s text
    sections.py   what a section is made of (`resolve`, `check`), `ConfigError`
    registry.py   the registered tasks (`REGISTRY`): each one's config section is added to `Config`
    key_hints.py  the one-line error for an unknown key
"""
