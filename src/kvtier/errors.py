"""kvtier's exceptions. Every message says what was wrong and what to do about it."""


class KVTierError(Exception):
    """Base class of every error kvtier raises on purpose."""


class ConfigError(KVTierError):
    """A configuration value (file, environment variable, flag or JSON) is invalid."""


class InputError(KVTierError):
    """Tokens or KV tensors handed to kvtier do not match what was declared."""


class CorruptRecordError(KVTierError):
    """A stored chunk record failed its magic, length, checksum, key or token-id check."""


class RecordAuthError(CorruptRecordError):
    """A stored chunk record's tag (``l2_record_key``) is missing or wrong: forged, or written without the key."""


class ForeignRecordError(CorruptRecordError):
    """A stored chunk record is signed with a record key this reader does not hold (another deployment's, or
    a key rotated out), or signed while this reader has none: not servable here, but not damaged either, so
    it is a miss that is never deleted (``kvtier_l2_foreign_records_total``)."""


class StorageError(KVTierError):
    """An L2 adapter operation failed. The cache turns it into a miss plus a metric."""


class ProtocolError(KVTierError):
    """A server message is malformed, of the wrong version, or refused."""


class CodecError(CorruptRecordError):
    """Encoded KV bytes do not decode to the chunk their layout describes: corrupt, truncated, a decoded size that
    differs from the layout's, or parameters the codec does not know. A corrupt record to the cache (a miss)."""


class UnknownCodecError(ConfigError):
    """A codec name (in the configuration, or in a record written by another kvtier) is not one this kvtier has."""


class BlendUnsupportedError(InputError):
    """A model's position encoding cannot be re-rotated exactly (``kvtier.blend.rope``): blending is refused for
    it and a connector falls back to prefix reuse."""
