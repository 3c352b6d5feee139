"""Operations around the library: SLURM submission (``submit``) and the end-to-end demo
(``demo``, ``demo_data``). May import every other ``pipelines`` sub-package, ``data_prep``,
``models``, ``monitoring`` and ``core``; only the entry points import it.
"""
