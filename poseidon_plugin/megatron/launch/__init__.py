"""The --poseidon-auto flow: options, argv rewrite, bring-up, discovery, the judge, renumbering, the entry points."""
