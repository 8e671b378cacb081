"""gradshard's benchmark scripts (installed as the package ``gradshard.bench``).

Each ``bench_NAME.py`` is a script: ``gradshard bench NAME [ARGS]`` runs it (``gradshard bench
list`` lists them), as does ``python bench/bench_NAME.py`` in a source checkout. Their tables go
to ``bench/RESULTS.md`` in a checkout and to ``./RESULTS.md`` (raw data under ``./out/``)
when gradshard is installed without one (:mod:`results_md`). ``bench_hf.py`` and
``hf_matrix.py`` build their models from the test suite's zoo (``tests/hf/zoo.py``) and run
only in a checkout.
"""
