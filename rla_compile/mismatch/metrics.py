"""Train/inference mismatch metrics, as RL frameworks log them.

Per scored token t (sampled by the inference engine, scored by both stacks) let
δ = log π(t) - log μ(t): the trainer's logprob minus the inference engine's, i.e. the log of the
importance ratio r = π/μ an off-policy correction would apply. Then

    k1    = mean(-δ)               unbiased estimate of KL(μ‖π) from samples of μ (can be < 0)
    k3    = mean(r - 1 - δ)        Schulman's low-variance, always >= 0 estimate of KL(μ‖π)
    RMS δ = sqrt(mean(δ²))         the spread of the log ratio
    mean exp(|δ|)                  how far a typical importance weight is from 1 (1 = none)

plus |Δ logprob| = |δ| and |Δp| = |π(t) - μ(t)| (mean and max), the exact full-vocabulary
KL(μ‖π) averaged over positions (needs both full distributions), and the fraction of tokens
whose logprobs are bitwise equal. Everything is computed in float64 from the fp32 logprobs the
stacks produce, so the metrics add no rounding of their own.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch

__all__ = ["Metrics", "Routing", "compare_logprobs", "k3", "k3_rows", "routing_agreement", "ulp_distance"]


def k3_rows(delta: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimate of KL(μ‖π) from δ = log π - log μ at tokens sampled from μ, one
    per row: mean(e^δ - 1 - δ) over the last dimension, in δ's dtype."""
    return (delta.exp() - 1 - delta).mean(-1)


def k3(delta: torch.Tensor) -> float:
    """k3 over all of δ, in float64."""
    return float(k3_rows(delta.double().reshape(-1)))


MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, torch.float64: 52}


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units in the last place of the larger of |a|, |b| in their dtype, elementwise
    (float64). 1 means neighbours; values of opposite sign near zero are not counted as the
    tens of thousands of representable values between them."""
    if a.dtype != b.dtype or a.shape != b.shape:
        raise ValueError(f"compare tensors of one dtype and shape, got {a.dtype}{list(a.shape)} and {b.dtype}{list(b.shape)}")
    if a.dtype not in MANTISSA_BITS:
        raise ValueError(f"ulp distance needs a floating dtype, got {a.dtype}")
    x, y = a.double(), b.double()
    _, exponent = torch.frexp(torch.maximum(x.abs(), y.abs()))
    tiny = torch.finfo(a.dtype).smallest_normal * 2.0 ** -MANTISSA_BITS[a.dtype]
    ulp = torch.clamp(torch.ldexp(torch.ones_like(x), exponent - 1 - MANTISSA_BITS[a.dtype]), min=tiny)
    return torch.where(x == y, torch.zeros_like(x), (x - y).abs() / ulp)


@dataclass(frozen=True)
class Metrics:
    tokens: int
    k3: float
    k1: float
    mean_abs_dlogprob: float
    max_abs_dlogprob: float
    mean_abs_dp: float
    max_abs_dp: float
    rms_delta: float
    mean_exp_abs_delta: float
    kl_full: float
    bitwise_equal: float

    COLUMNS = (
        ("k3", "k3 KL"), ("k1", "k1"), ("mean_abs_dlogprob", "mean|Δlp|"), ("max_abs_dlogprob", "max|Δlp|"),
        ("mean_abs_dp", "mean|Δp|"), ("max_abs_dp", "max|Δp|"), ("rms_delta", "RMS δ"),
        ("mean_exp_abs_delta", "E exp|δ|"), ("kl_full", "KL full"), ("bitwise_equal", "bitwise="),
    )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def compare_logprobs(train: torch.Tensor, infer: torch.Tensor, tokens: torch.Tensor) -> Metrics:
    """Metrics between two stacks' full log-distributions at the same positions.

    train, infer: [N, V] log-probabilities (any float dtype; each row a log-softmax) that the
    trainer (π) and the inference engine (μ) give the N scored positions; tokens: [N] the token
    sampled at each position.
    """
    if train.shape != infer.shape or train.ndim != 2:
        raise ValueError(f"expected two [N, V] logprob tensors of one shape, got {tuple(train.shape)} and {tuple(infer.shape)}")
    if tokens.shape != train.shape[:1]:
        raise ValueError(f"expected one token per position ({train.shape[0]}), got tokens of shape {tuple(tokens.shape)}")
    if train.shape[0] == 0:
        raise ValueError("no positions to compare: the sequences have no scored tokens")
    lp_train = train.gather(-1, tokens[:, None].long())[:, 0]
    lp_infer = infer.gather(-1, tokens[:, None].long())[:, 0]
    equal = float((lp_train == lp_infer).double().mean())
    pi, mu = train.double(), infer.double()
    delta = lp_train.double() - lp_infer.double()
    dp = (lp_train.double().exp() - lp_infer.double().exp()).abs()
    # KL(μ‖π) = Σ_v μ(v) (log μ(v) - log π(v)); 0·log 0 terms are 0.
    mu_p = mu.exp()
    kl_terms = torch.where(mu_p > 0, mu_p * (mu - pi), torch.zeros_like(mu))
    return Metrics(
        tokens=int(delta.numel()),
        k3=k3(delta),
        k1=float((-delta).mean()),
        mean_abs_dlogprob=float(delta.abs().mean()),
        max_abs_dlogprob=float(delta.abs().max()),
        mean_abs_dp=float(dp.mean()),
        max_abs_dp=float(dp.max()),
        rms_delta=math.sqrt(float((delta**2).mean())),
        mean_exp_abs_delta=float(delta.abs().exp().mean()),
        kl_full=float(kl_terms.sum(-1).mean()),
        bitwise_equal=equal,
    )


@dataclass(frozen=True)
class Routing:
    """How often two stacks' MoE routers choose the same experts. Per (token, MoE layer): the
    share of the k experts both chose, the order within the k not compared; `agreement` is its
    mean, `per_layer` its mean per layer, `all_k_agree` the share of (token, layer) pairs where
    every one of the k agrees, over `pairs` such pairs."""
    agreement: float
    per_layer: list[float]
    all_k_agree: float
    pairs: int

    def to_dict(self) -> dict:
        return asdict(self)


def routing_agreement(chosen, other) -> Routing:
    """`chosen` and `other`: each sequence's expert ids, [T, layers, k] per sequence (a list, or
    a [B, T, layers, k] tensor), the same sequences on both sides."""
    shares = []
    for a, b in zip(chosen, other, strict=True):
        if a.shape != b.shape:
            raise ValueError(f"expert ids of one sequence differ in shape: {list(a.shape)} vs {list(b.shape)}")
        shares.append((a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1).double().mean(-1))  # [T, layers]
    every = torch.cat(shares)
    return Routing(float(every.mean()), [float(x) for x in every.mean(0)], float((every == 1).double().mean()),
                   every.numel())
