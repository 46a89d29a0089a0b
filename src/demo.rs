//! The `demo` command (filled in below).
#[derive(clap::Args)]
pub struct DemoArgs {}
pub async fn run(_a: DemoArgs) -> anyhow::Result<()> {
    anyhow::bail!("not yet")
}
