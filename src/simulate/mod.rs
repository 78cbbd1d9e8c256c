//! placeholder until the simulate branch lands
#[derive(Debug, clap::Args)]
pub struct SimulateArgs {}
pub async fn run(_a: SimulateArgs) -> Result<(), std::io::Error> {
    Ok(())
}
