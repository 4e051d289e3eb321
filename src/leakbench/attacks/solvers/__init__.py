"""The shared maths of the attacks: closed-form and least-squares solvers, gradient matching and its objectives,
feature blocks and tensor moments, peeling and the linear algebra they share.  No attack is registered here."""
