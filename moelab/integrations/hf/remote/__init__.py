"""The code that ``moelab export --format remote`` copies into an exported folder:
``configuration_moelab.py`` (the config class) and ``modeling_moelab.py`` (the causal LM
around moelab's own Transformer), loaded by transformers with ``trust_remote_code=True``.
They import nothing from this package but themselves and ``moelab``'s public modules, so
they work from the exported folder as from here."""
