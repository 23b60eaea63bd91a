"""The funnel's first-stage ranker (Instagram Explore's): a light two-tower model trained on the
heavy ranker's top-K choices (`preprocess first-stage`, data/interactions/first_stage_labels.py),
exported with `export --retrieval`. Its item side is cached: the export's item vectors, computed
once from the item tower, so scoring a request's ~1,000 candidates is one user-tower call and
one [E] x [E, N] product; the best go on to the heavy ranker."""

from __future__ import annotations

from pathlib import Path

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

    def order(self, user: int, items: np.ndarray) -> np.ndarray:
        """`items` best first by the model's score (ties: their order); the caller keeps the
        best it passes on, after fusing this order with the one it was handed."""
        items = np.asarray(items, np.int64)
        if not len(items):
            return items
        return items[np.argsort(-self.scores(user, items), kind="stable")]
