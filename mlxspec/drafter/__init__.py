"""Co-designed drafters: heads that read the target's hidden state, and training them."""
