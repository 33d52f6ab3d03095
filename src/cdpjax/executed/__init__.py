"""The executed timetables: CDP run for real on stage devices (``pipeline``) or on workers that
each own a stage (``zero``).

``staged`` cuts a flax model into stage functions over flat buffers, ``plan``
holds the static slot plans (numpy), and both executors follow the contract of
``cdpjax.executor``.
"""
