"""ModelConfig: the sizes of TinyGPT, and their match with Hugging Face's `LlamaConfig`.

Every engine module takes this one dataclass, as every module of nanoGPT takes its config:
the model (`labkit.engine.model`), the paged KV cache (`labkit.engine.kv`), the checkpoint
loader. It imports only `labkit.engine.attention` and `labkit.engine.rope`, which take no
config, so no import circle passes through it.

Invariants:

- a ModelConfig is valid once built: every size is a whole number >= 1, the heads divide
  d_model, the key/value heads divide the query heads, a head's size is even (rotary
  positions rotate pairs), and the begin-of-sequence token is in the vocabulary; anything
  else raises a ValueError that names the field;
- `from_hf_llama_config(to_hf_llama_config())` gives the config back, but for `attention`,
  which is no part of a checkpoint (it comes back "batched"); a ValueError names the first
  field of an HF config that TinyGPT cannot express.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from labkit.checks import flag, number, whole_number
from labkit.engine.attention import ATTENTION_LAYOUTS
from labkit.engine.rope import LLAMA3_FIELDS, ROPE_SCALING_TYPES, RopeScaling

# ModelConfig field -> the same field in Hugging Face's LlamaConfig
_HF_NAMES = (
    ("vocab_size", "vocab_size"),
    ("d_model", "hidden_size"),
    ("n_layers", "num_hidden_layers"),
    ("n_heads", "num_attention_heads"),
    ("d_ff", "intermediate_size"),
    ("max_seq_len", "max_position_embeddings"),
    ("norm_eps", "rms_norm_eps"),
)


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of TinyGPT. `max_seq_len` is the longest sequence (prompt + output) it accepts.

    attention: "batched" (one pass per layer over every request) or "per_request" (Orca's
    loop); both give the same tokens, and neither changes a weight.
    The fields after it describe checkpoints; their defaults are the seeded TinyGPT's:
    n_kv_heads: key/value heads (None: n_heads), a divisor of n_heads;
    explicit_head_dim: the size of a head when it is not d_model / n_heads (None: it is);
    tie_embeddings: the LM head is the embedding matrix;
    rope_scaling: how the rotary frequencies are scaled (None: not at all);
    bos_token_id: the begin-of-sequence token every sequence starts with.
    """

    vocab_size: int = 512
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 768
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    attention: str = "batched"
    n_kv_heads: int | None = None
    explicit_head_dim: int | None = None
    tie_embeddings: bool = False
    rope_scaling: RopeScaling | None = None
    bos_token_id: int = 0

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"):
            whole_number(name, getattr(self, name))
        for name in ("n_kv_heads", "explicit_head_dim"):  # None: derived from n_heads and d_model
            whole_number(name, getattr(self, name), or_none=True)
        for name in ("rope_theta", "norm_eps"):
            number(name, getattr(self, name))
        if self.attention not in ATTENTION_LAYOUTS:
            raise ValueError(f"attention = {self.attention!r}: must be one of {', '.join(ATTENTION_LAYOUTS)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model = {self.d_model}: must be divisible by n_heads = {self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_kv_heads = {self.n_kv_heads}: must divide n_heads = {self.n_heads}")
        if self.head_dim % 2:
            field = "d_model" if self.explicit_head_dim is None else "explicit_head_dim"
            raise ValueError(f"{field} = {getattr(self, field)}: the head size must be even for rotary positions")
        flag("tie_embeddings", self.tie_embeddings)
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"rope_scaling = {self.rope_scaling!r}: must be None or a RopeScaling")
        bos = self.bos_token_id
        if isinstance(bos, bool) or not isinstance(bos, int) or not 0 <= bos < self.vocab_size:
            raise ValueError(f"bos_token_id = {bos!r}: must be a token id in 0..{self.vocab_size - 1}")

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_heads, or n_heads when it is None."""
        return self.n_kv_heads or self.n_heads

    def to_hf_llama_config(self):
        """The matching `transformers.LlamaConfig` (fp32, eager attention, no EOS)."""
        from transformers import LlamaConfig

        scaling = {} if self.rope_scaling is None else {"rope_scaling": {
            name: value for name, value in asdict(self.rope_scaling).items() if value is not None}}
        return LlamaConfig(
            **{hf_name: getattr(self, name) for name, hf_name in _HF_NAMES},
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            rope_theta=self.rope_theta,
            **scaling,
            hidden_act="silu",
            attention_bias=False,
            mlp_bias=False,
            tie_word_embeddings=self.tie_embeddings,
            bos_token_id=self.bos_token_id,
            eos_token_id=None,
            pad_token_id=None,
            attn_implementation="eager",
        )

    @classmethod
    def from_hf_llama_config(cls, hf_config) -> ModelConfig:
        """The ModelConfig of an HF `LlamaConfig`; a ValueError names the field TinyGPT cannot express."""
        rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        checks = {
            "model_type": (getattr(hf_config, "model_type", "llama"), ("llama",)),
            "hidden_act": (hf_config.hidden_act, ("silu",)),
            "attention_bias": (hf_config.attention_bias, (False,)),
            "mlp_bias": (getattr(hf_config, "mlp_bias", False), (False,)),
            "rope_type": (rope_type, ("default", *ROPE_SCALING_TYPES)),
            "partial_rotary_factor": (rope.get("partial_rotary_factor", 1.0), (1.0,)),
        }
        for name, (value, supported) in checks.items():
            if value not in supported:
                raise ValueError(f"{name} = {value!r}: TinyGPT supports {' or '.join(map(repr, supported))}")
        if hf_config.bos_token_id is None:
            raise ValueError("bos_token_id = None: TinyGPT starts every sequence with a begin-of-sequence token")
        n_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // n_heads
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or n_heads
        return cls(
            **{name: getattr(hf_config, hf_name) for name, hf_name in _HF_NAMES},
            rope_theta=float(rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))),
            n_kv_heads=None if kv_heads == n_heads else kv_heads,
            explicit_head_dim=None if head_dim == hf_config.hidden_size // n_heads else head_dim,
            tie_embeddings=bool(hf_config.tie_word_embeddings),
            rope_scaling=None if rope_type == "default" else hf_rope_scaling(rope_type, rope),
            bos_token_id=hf_config.bos_token_id,
        )


def hf_rope_scaling(rope_type: str, rope: dict) -> RopeScaling:
    """The RopeScaling of an HF config's rope parameters (rope_type "linear" or "llama3")."""
    names = ("factor",) if rope_type == "linear" else ("factor", *LLAMA3_FIELDS)
    return RopeScaling(rope_type, **{name: rope.get(name) for name in names})
