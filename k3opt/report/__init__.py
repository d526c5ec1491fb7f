"""What a person reads: the text tables of a ledger and a plan, the pictures, and the validation against
measured memory and throughput."""
