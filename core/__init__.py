"""The bottom layer every stage builds on: config primitives, atomic files, the corpus format.

Owns ``config`` (typed dataclasses loaded strictly from YAML), ``files`` (atomic writes, sha256),
``corpus`` (manifest schema, shard naming, sample keys, tar reading: the one definition that
``data_prep`` writes and ``pipelines.loading`` reads) and ``optim_math`` (closed-form optimizer
quantities). Imports nothing from the project and never torch, so it is cheap everywhere.
"""
