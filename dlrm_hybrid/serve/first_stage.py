"""The funnel's first-stage ranker (Instagram Explore's): a light two-tower model trained on the
heavy ranker's top-K choices (`preprocess first-stage`, data/interactions/first_stage_labels.py),
exported with `export --retrieval`. Its item side is cached: the export's item vectors, computed
once from the item tower, so scoring a request's ~1,000 candidates is one user-tower call and
one [E] x [E, N] product; the best `keep` go on to the heavy ranker."""

from __future__ import annotations

from pathlib import Path
from typing import Tuple

import numpy as np

from dlrm_hybrid.errors import UserError


class FirstStage:
    """An `export --retrieval` folder of a first-stage model whose users and items are the
    retrieval folder's (the same raw ids in the same dense order)."""

    def __init__(self, folder: str, retriever) -> None:
        from dlrm_hybrid.serve.retrieve import DESCRIPTION, Retriever

        if not (Path(folder) / DESCRIPTION).is_file():
            raise UserError(f"--first-stage: {folder} has no {DESCRIPTION}; give the folder "
                            f"`export --retrieval` wrote of a model trained on `preprocess "
                            f"first-stage`'s dataset")
        self.model = Retriever(folder)
        for what, mine, theirs in (("items", self.model.item_names, retriever.item_names),
                                   ("users", self.model.user_names, retriever.user_names)):
            if mine != theirs:
                raise UserError(f"--first-stage: {folder}'s {what} are not the retrieval "
                                f"model's ({len(mine or ())} against {len(theirs or ())}, or "
                                f"in another order); train it on `preprocess first-stage "
                                f"--retrieval` the retrieval model's dataset")

    def scores(self, user: int, items: np.ndarray) -> np.ndarray:
        """[N] the model's score of each of `items` for `user` (dense ids): <user vector, cached
        item vector>, the training logit times model.temperature."""
        vector = self.model.user_vectors(np.array([user], np.int64))[0]
        return self.model.item_vectors[np.asarray(items, np.int64)] @ vector

    def keep(self, user: int, items: np.ndarray, n: int) -> Tuple[np.ndarray, np.ndarray]:
        """The `n` of `items` the model scores highest, best first (ties: their order), with
        their scores."""
        items = np.asarray(items, np.int64)
        if not len(items):
            return items, np.zeros(0, np.float32)
        scores = self.scores(user, items)
        order = np.argsort(-scores, kind="stable")[:n]
        return items[order], scores[order]
