"""What both apps share, below them: errors (``ApplicationError``, the DRF exception
handler, the strict JSON parser), the clock, the K3 strict input rule, the one after-commit
broadcast (B2), the B11 keyset cursor, throttling (K3), the OpenAPI error shape and the U5
read-only admin bases. Imports no app and nothing from ``config/``."""
