"""The debugger's and faults' notebook halves: :mod:`.console` answers the ranks' pdb prompts
(its worker half is :mod:`nbdist.runtime.debugger`), :mod:`.faults` injects failures on purpose
(:mod:`nbdist.runtime.faults`)."""
