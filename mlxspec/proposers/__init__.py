"""Proposers: who guesses the next tokens for the target to verify."""

from mlxspec.proposers.base import Draft, ProposalContext, Proposer, Situation
from mlxspec.proposers.chain import Chain
from mlxspec.proposers.draft_model import DraftModel, check_same_vocabulary, truncated_model
from mlxspec.proposers.lookahead import Lookahead
from mlxspec.proposers.lookup import PromptLookup
from mlxspec.proposers.self_spec import SelfSpeculation

__all__ = [
    "Chain",
    "Draft",
    "DraftModel",
    "Lookahead",
    "PromptLookup",
    "ProposalContext",
    "Proposer",
    "SelfSpeculation",
    "Situation",
    "check_same_vocabulary",
    "truncated_model",
]
