"""Moving a training state between the members of a generation: the one description wire format a
member sends its peers (its reader checks every section), the pure bucket plan, and the transfer
from every holder to the members that need the state."""
