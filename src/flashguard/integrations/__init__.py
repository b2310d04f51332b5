"""Integrations with other libraries, one module each, imported only when asked for.

``flashguard.integrations.hf``: flashguard as a Hugging Face transformers attention
implementation (``pip install 'flashguard[hf]'``). ``flashguard.integrations.hf_callback``:
``FlashguardCallback``, flashguard's probes (``flashguard.watch``) as a transformers
``TrainerCallback``. Importing this package imports none of them,
so ``import flashguard`` never imports transformers.
"""
