//! The SVG plot: bus bandwidth against size, measured (solid) and predicted (dashed), one colour
//! per op. Drawn with plotters' SVG backend (text is emitted as SVG text; no fonts are read).

use plotters::prelude::*;

use super::report::Report;

/// Write the plot of `r` to `path`.
pub fn write_svg(r: &Report, path: &std::path::Path) -> Result<(), String> {
    let rows: Vec<_> = r
        .rows
        .iter()
        .filter(|x| !x.inplace && x.bytes > 0)
        .collect();
    if rows.is_empty() {
        return Err("nothing to plot (no non-empty sizes)".into());
    }
    let min_b = rows.iter().map(|x| x.bytes).min().unwrap() as f64;
    let max_b = rows.iter().map(|x| x.bytes).max().unwrap() as f64;
    let max_y = rows
        .iter()
        .flat_map(|x| {
            let pred_bus = x
                .predicted_us
                .map(|p| x.busbw_gbs * x.time_us / p)
                .unwrap_or(0.0);
            [x.busbw_gbs, pred_bus]
        })
        .fold(0.0f64, f64::max)
        .max(1e-3)
        * 1.1;
    let root = SVGBackend::new(path, (960, 600)).into_drawing_area();
    let err = |e: &dyn std::fmt::Display| e.to_string();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let title = format!(
        "ringzero bench: {} ranks, {} {}",
        r.header.ranks, r.header.dtype, r.header.redop
    );
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(20)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((min_b..max_b.max(min_b * 2.0)).log_scale(), 0.0..max_y)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("size (bytes)")
        .y_desc("bus bandwidth (GB/s)")
        .x_label_formatter(&|b| super::report::size_text(*b as usize))
        .draw()
        .map_err(|e| err(&e))?;
    let mut ops: Vec<&str> = rows.iter().map(|x| x.op.as_str()).collect();
    ops.dedup();
    for (k, op) in ops.iter().enumerate() {
        let colour = Palette99::pick(k).to_rgba();
        let mine: Vec<_> = rows.iter().filter(|x| x.op == *op).collect();
        let measured: Vec<(f64, f64)> =
            mine.iter().map(|x| (x.bytes as f64, x.busbw_gbs)).collect();
        chart
            .draw_series(LineSeries::new(measured, colour.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(format!("{op} measured"))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2))
            });
        let predicted: Vec<(f64, f64)> = mine
            .iter()
            .filter_map(|x| {
                x.predicted_us
                    .map(|p| (x.bytes as f64, x.busbw_gbs * x.time_us / p))
            })
            .collect();
        chart
            .draw_series(DashedLineSeries::new(
                predicted,
                6,
                4,
                colour.stroke_width(1),
            ))
            .map_err(|e| err(&e))?
            .label(format!("{op} α–β prediction"))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(1))
            });
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
