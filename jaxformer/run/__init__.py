"""The run wing: the config, the run directory's files, checkpoints, metrics and logs. Below
``data``, ``decode``, ``interop`` and ``train``; it imports only the ``model`` wing."""
