"""Operations around the library: SLURM submission (``submit``), the end-to-end demo
(``demo``, ``demo_data``) and the torch-free run planner (``plan``, ``plan_constants``, ``model_shapes``). May import every other ``pipelines`` sub-package, ``data_prep``,
``models``, ``monitoring`` and ``core``; only the entry points import it.
"""
