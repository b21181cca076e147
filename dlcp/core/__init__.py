"""Sans-IO core: bucket layout, aggregation state machine, loss and rate maths."""
