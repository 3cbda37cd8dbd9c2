"""What the workers watch at their step boundaries, each rule pure and beside its watch: stragglers
(the rule, then the exchange of step times), silent corruption (the replicas' checksums), and
non-finite losses and gradients; the DDP bucket hook that feeds two of them."""
