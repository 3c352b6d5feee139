"""The optimizer x warmup study: ``sweep`` runs the grid (locally or as a SLURM array) and
``analysis`` reads the sweep directory back into tables and figures (`pretrain report`).

May import ``pipelines.engine``, ``pipelines.loading``, ``monitoring``, ``models`` and ``core``.
"""
