"""Skip connections: a layer stashes a tensor under a name, a later layer pops it (torchgpipe's
``torchgpipe.skip`` API, under the same names).

Example::

    from gpipe.skip import pop, skippable, stash

    @skippable(stash=['skip'])
    class Save(nn.Module):
        def forward(self, x):
            yield stash('skip', x)
            return x

    @skippable(pop=['skip'])
    class Add(nn.Module):
        def forward(self, x):
            return x + (yield pop('skip'))

    model = nn.Sequential(Save(), nn.Linear(4, 4), Add())

The model runs as it is, or in a ``gpipe.Pipe``, where a skip goes straight
from the stage that stashes it to the stage that pops it.
"""
from gpipe.skip.namespace import Namespace
from gpipe.skip.skippable import Skippable, pop, skippable, stash, verify_skippables

__all__ = ["skippable", "stash", "pop", "verify_skippables", "Namespace", "Skippable"]
